"""Blocking work of a call (the encoder, SQLite, FAISS) off the event loop, under the call's hold
on its tenant's limits.

A thread cannot be stopped: when the caller leaves (an HTTP disconnect, a gRPC cancel or
deadline) while the work runs, the work goes on, so the tenant's hold goes on with it
(`Lease.hold_for`): its concurrency slot stays taken and the tokens the work reads are paid
when it ends. Work still queued for a thread is dropped instead, and the hold settles at once.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Any, Callable, TypeVar

from jaxserve.gateway.limits import Lease

T = TypeVar("T")


def no_tokens(result: Any) -> int:
    return 0


def encoder_tokens(result: tuple) -> int:
    """Of an encoder call's (vectors, scores or chunks, tokens read)."""
    return result[1]


async def run_held(executor: Executor, lease: Lease | None, fn: Callable[..., T], *args,
                   used_tokens: Callable[[T], int] = no_tokens, **kwargs) -> T:
    """`fn(*args, **kwargs)` on `executor`; `used_tokens(result)`: what it read, for a hold
    that outlives its call."""
    work = executor.submit(functools.partial(fn, *args, **kwargs))
    if lease is not None:
        lease.hold_for(work, used_tokens)
    # Cancelling the awaiting task cancels `work` only while it waits for a thread.
    return await asyncio.wrap_future(work)

"""Async stream helpers of the serving layer: one engine stream per prompt merged into one, and
keep-alive markers while a stream is silent (queued, or a slow step)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator


async def with_keepalive(agen: AsyncIterator, interval: float) -> AsyncIterator:
    """Yield the generator's items, and None whenever `interval` passes without one."""
    pending = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(agen.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as (stream index, output) in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()

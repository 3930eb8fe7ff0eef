"""Async stream helpers of the serving layer: one engine stream per prompt merged into one,
keep-alive markers while a stream is silent (queued, or a slow step), and the write timeout of a
client that stopped reading."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable


class StreamStalled(ConnectionResetError):
    """The client stopped reading: one write to it waited longer than the server's
    stream_write_timeout_s. Its request ends as a client that left does (outcome
    client_disconnected, engine requests aborted, pages freed) and its connection is dropped."""


async def write_within(write: Awaitable, timeout_s: float) -> None:
    """Await one write to a client, or raise StreamStalled after `timeout_s`. In the caller's
    task (not wait_for's own): a handler cancelled because its client left must see its
    CancelledError, not the write's "closing transport" error that wait_for would return."""
    try:
        async with asyncio.timeout(timeout_s):
            await write
    except TimeoutError:
        raise StreamStalled(f"the client read nothing for {timeout_s:g} s") from None


async def with_keepalive(agen: AsyncIterator, interval: float) -> AsyncIterator:
    """Yield the generator's items, and None whenever `interval` passes without one. One task
    pulls the generator for the whole stream: a task and an asyncio.wait per item cost several
    times an item's own handling (RESULTS.md, "Host gap between steps"). Its queue holds one
    item, so it pulls no further ahead of its reader than that."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    end = object()
    task = asyncio.ensure_future(_pump(queue, None, agen, end))
    try:
        while True:
            try:
                async with asyncio.timeout(interval):
                    _, item = await queue.get()
            except TimeoutError:
                yield None
                continue
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()


async def _pump(queue: asyncio.Queue, key, agen: AsyncIterator, end) -> None:
    """Put (key, item) for each of agen's items, then (key, end), or (key, the error it
    raised); a cancelled pump closes agen (AsyncEngine.generate then aborts its request)."""
    try:
        async for item in agen:
            await queue.put((key, item))
        await queue.put((key, end))
    except Exception as exc:  # noqa: BLE001 - forwarded to the reader
        await queue.put((key, exc))


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams as (stream index, output) in arrival order. A pump
    waits for the reader before it pulls again, so a reader that stops (its client stopped
    reading) leaves each engine stream holding only its latest output (AsyncEngine's
    `_Stream`), not a copy per step here."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    done = object()
    tasks = [asyncio.ensure_future(_pump(queue, i, s, done)) for i, s in enumerate(streams)]
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

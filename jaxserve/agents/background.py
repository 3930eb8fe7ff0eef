"""The server's background runs: tasks owned by the server, not by a request, so a run goes on
without a connection. `cancel` stops one (its model turn's engine request is aborted as the
task unwinds, so its KV pages return at once); `close` stops all at shutdown with
run.SHUTDOWN, which leaves them resumable. Readers of a run's recorded stream wait for its
next event (`changed`). Host side: no JAX."""

from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

from jaxserve.agents.run import SHUTDOWN

log = logging.getLogger(__name__)


class BackgroundRuns:
    def __init__(self):
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def start(self, response_id: str, run: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(run, name=f"run {response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda t: self._ended(response_id, t))

    def _ended(self, response_id: str, task: asyncio.Task) -> None:
        self._tasks.pop(response_id, None)
        self.notify(response_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("background run %s failed", response_id, exc_info=task.exception())

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> bool:
        """Stop the run and wait until it has unwound (its status written); False when it was
        not running here."""
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.wait({task})
        return True

    def notify(self, response_id: str) -> None:
        """The run recorded an event, or ended."""
        event = self._changed.pop(response_id, None)
        if event is not None:
            event.set()

    def changed(self, response_id: str) -> asyncio.Event:
        """Set at the run's next event or end: take it before reading what was recorded, then
        wait on it, and nothing recorded in between is missed."""
        return self._changed.setdefault(response_id, asyncio.Event())

    def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel(SHUTDOWN)

"""AsyncEngine's loop, driven over a scripted engine (no model): a burst of admissions is taken a
bounded slice per step while running requests keep stepping; a step that never returns is reported
as a stall (with the engine thread's stack) and shutdown says the thread is wedged."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine import EngineStats
from jaxserve.errors import EngineDead, EngineOverloaded
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.sampling_params import SamplingParams


class ScriptedEngine:
    """LLMEngine's surface as AsyncEngine uses it. Every request finishes at the first step after
    it was added; `log` records ("add", sequences) and ("step", None) in order; a step can be
    held on `gate` to pile commands up in the inbox, or made to hang forever."""

    def __init__(self, max_num_seqs: int = 4):
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.log: list[tuple[str, int | None]] = []
        self.pending: list[PreparedRequest] = []
        self.gate = threading.Event()
        self.gate.set()
        self.hang = threading.Event()
        self.sleeping_tags: frozenset[str] = frozenset()  # never asleep

    def prepare(self, request_id, prompt, params, priority=0, *, qos=None,
                fitted=False) -> PreparedRequest:
        return PreparedRequest(request_id, None, [1], params or SamplingParams())

    def add_prepared(self, prepared: PreparedRequest) -> None:
        self.log.append(("add", prepared.params.n))
        self.pending.append(prepared)

    def abort(self, request_id) -> bool:
        return False

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        self.log.append(("step", None))
        self.gate.wait()
        while self.hang.is_set():
            wedged_in_a_step()
        done, self.pending = self.pending, []
        return [RequestOutput(p.request_id, None, [1],
                              [CompletionOutput(i, "x", [7], "length") for i in range(p.params.n)],
                              finished=True) for p in done]

    def stats(self) -> EngineStats:
        return EngineStats(0, len(self.pending), 0, 0, 10, 0, 0, 0, 0, 0, 0, {})


def wedged_in_a_step() -> None:
    time.sleep(0.01)


def wait_for(predicate, what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def _generate(engine: AsyncEngine, n: int) -> list:
    return [out async for out in engine.generate([1], SamplingParams(n=n))]


def test_a_burst_is_admitted_a_bounded_slice_per_step():
    scripted = ScriptedEngine()
    engine = AsyncEngine(scripted, max_sequences_per_step=16, stall_timeout=None)

    async def main():
        scripted.gate.clear()  # hold the loop in its first step while 60 requests of n = 4 arrive
        first = asyncio.ensure_future(_generate(engine, 1))
        await until(lambda: scripted.log)
        burst = [asyncio.ensure_future(_generate(engine, 4)) for _ in range(60)]
        await until(lambda: engine.num_queued >= 240)
        scripted.gate.set()
        return await first, await asyncio.gather(*burst)

    try:
        first, burst = asyncio.run(main())
    finally:
        scripted.gate.set()
        assert engine.shutdown(10)
    assert first[-1].finished and all(len(b[-1].outputs) == 4 for b in burst)
    # Between two steps at most 16 sequences were admitted: 240 took at least 15 steps.
    added = 0
    for kind, sequences in scripted.log:
        added = added + sequences if kind == "add" else 0
        assert added <= 16
    assert sum(1 for kind, _ in scripted.log if kind == "step") >= 15
    assert engine.num_queued == 0


def test_a_step_that_never_returns_is_a_stall_with_the_engine_stack(caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.core.async_engine")
    scripted = ScriptedEngine()
    engine = AsyncEngine(scripted, stall_timeout=0.3)
    try:
        assert not engine.is_stalled  # idle is not stalled, however long
        time.sleep(0.5)
        assert not engine.is_stalled and engine.stalled_for == 0
        scripted.hang.set()

        async def main():
            task = asyncio.ensure_future(_generate(engine, 1))
            while not engine.is_stalled:
                await asyncio.sleep(0.01)
            task.cancel()  # the client gives up; the engine is still stuck in its step

        asyncio.run(asyncio.wait_for(main(), 30))
        wait_for(lambda: any("engine stalled" in r.getMessage() for r in caplog.records),
                 "the stall to be logged")
        message = next(r.getMessage() for r in caplog.records
                       if "engine stalled" in r.getMessage())
        assert "wedged_in_a_step" in message and "in step" in message
        assert not engine.shutdown(0.5)  # the thread cannot leave a step that never returns
        scripted.hang.clear()  # the step returns after all: the thread ends
        wait_for(lambda: not engine._thread.is_alive(), "the engine thread to end")
        assert not engine.is_stalled
    finally:
        scripted.hang.clear()
        engine.shutdown(10)


def test_preempted_sequences_do_not_fill_the_admission_queue():
    """Sequences waiting to resume after preemption are admitted work: a queue holding only them
    admits a new request instead of refusing it (nothing in it could be shed to make room)."""
    engine = AsyncEngine(ScriptedEngine(), stall_timeout=None)
    try:
        base = engine.stats()
        engine._stats = dataclasses.replace(base, num_waiting=4, num_new_by_priority={})
        assert engine.num_queued == 0
        engine.admit(2, max_queued=2, priority=0)  # preempted only: admitted
        engine._stats = dataclasses.replace(base, num_waiting=4, num_new_by_priority={0: 2})
        assert engine.num_queued == 2
        with pytest.raises(EngineOverloaded):  # two never-started of the same class: full
            engine.admit(1, max_queued=2, priority=0)
    finally:
        assert engine.shutdown(10)


class CountingEngine(ScriptedEngine):
    """Each request runs `steps` steps, one token a step: a cumulative snapshot every step, the
    last one finished (the output of every step, as LLMEngine's)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps
        self.done: dict[str, int] = {}

    def step(self) -> list[RequestOutput]:
        outputs = []
        for p in self.pending:
            k = self.done[p.request_id] = self.done.get(p.request_id, 0) + 1
            outputs.append(RequestOutput(p.request_id, None, [1],
                                         [CompletionOutput(0, "x" * k, [7] * k,
                                                           "length" if k == self.steps else None)],
                                         finished=k == self.steps))
        self.pending = [p for p in self.pending if self.done[p.request_id] < self.steps]
        return outputs


def test_a_caller_that_stops_reading_holds_one_snapshot_not_one_per_step():
    """Review H1: outputs are cumulative, so a stream keeps only the latest. A caller that takes
    nothing after its first output while the engine runs 500 steps then gets one more, the
    finished one (which, like an error, is never replaced), not 499 queued copies."""
    counting = CountingEngine(steps=500)
    engine = AsyncEngine(counting, stall_timeout=None)

    async def main():
        stream = engine.generate([1], SamplingParams())
        first = await stream.__anext__()
        await until(lambda: not counting.has_unfinished())  # 499 more steps, none read
        return first, [out async for out in stream]

    try:
        first, rest = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        assert engine.shutdown(10)
    outs = [first, *rest]  # the first may already be the last, had the engine run ahead
    assert len(outs) <= 2 and outs[-1].finished and outs[-1].outputs[0].token_ids == [7] * 500


def test_an_error_after_unread_outputs_is_delivered():
    counting = CountingEngine(steps=10_000)
    engine = AsyncEngine(counting, stall_timeout=None)

    async def main():
        stream = engine.generate([1], SamplingParams())
        await stream.__anext__()
        await until(lambda: sum(counting.done.values()) > 50)  # unread snapshots meanwhile
        engine.fail(EngineDead("gone"))
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown(10)

"""AsyncEngine: the LLMEngine step loop on its own thread, streamed to asyncio callers (a
ServingEngine, jaxserve.core.serving_engine).

The engine thread is the only one that touches engine state. Callers validate on their own thread
(`LLMEngine.prepare` reads only configs and the tokenizer), then hand the engine commands (add,
abort) through an inbox it drains before every step; outputs travel back to each request's
stream, which keeps only the latest (they are cumulative: `_Stream`). Stats are a snapshot the
thread publishes after each step, so a metrics scrape never reads state mid-update.

`num_queued` (sequences accepted and never started) is what a server's admission limit reads:
the scheduler's never-started waiting count of the last snapshot plus the sequences submitted
since, both updated under one lock so a request is never counted twice or not at all. Preempted
sequences waiting to resume are admitted work, not new demand: they do not count, so a queue of
them cannot make a more important request's admission fail when nothing in it can be shed. `admit` applies that
limit with shedding: when the queue is full, a request displaces never-started requests of less
important priorities (`LLMEngine.shed`) instead of being refused.

A caller that bills what was computed passes `generate` a `final` future: it receives the
request's last RequestOutput once the engine has ended the request, however it ended and whoever
stopped reading (a caller that leaves early aborts it, and the engine's output of that abort
counts the tokens drawn meanwhile, which a stream closed first never sees); None when it never
ran here (refused, or the engine died or stopped).

A request that ends by running out of time or by being shed raises a typed error from `generate`
after the outputs it already produced: DeadlineExceeded (finish_reason "deadline"), QueueTimeout
("queue_timeout"), EngineOverloaded ("shed"); the front ends map those to 504 / 429 / 503.

If a step raises, the engine is dead: every open stream gets EngineDead and new requests are
refused, rather than serving from a cache and scheduler in an unknown state. `fail` does the same
from another thread, for a death the step cannot see (a multi-host follower gone while idle).

Liveness: the loop takes at most `max_sequences_per_step` sequences' worth of commands from its
inbox per step, so a burst of admissions waits its turn while running requests keep stepping; and
it publishes a heartbeat (the time it last completed a step, or woke with work). A watchdog thread
reports the engine stalled once work is pending and no step has completed for `stall_timeout`
seconds (a wedged device call, a step that never returns), logging the engine thread's stack, so
/ready and gRPC health can turn not-ready and an operator can see where it hangs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import AsyncIterator, Callable, Sequence

from jaxserve.core.engine import EngineStats, LLMEngine
from jaxserve.errors import (DeadlineExceeded, EngineDead, EngineOverloaded, InvalidRequest,
                             JaxServeError, QueueTimeout, RequestFailed)
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.request import QoS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

# A hint for clients refused or shed by a full queue: a step or a few frees seats.
OVERLOADED_RETRY_AFTER_S = 1.0

log = logging.getLogger(__name__)


class _Stream:
    """One request's outputs on their way to its caller. They are cumulative, so the stream keeps
    only the latest: a caller that reads slower than the engine steps (a client that stopped
    reading) skips snapshots instead of queueing one per step, which grew memory as n * T^2. The
    last item (the finished output or an error) is never replaced, so it is never lost."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()  # the engine thread puts, the caller's loop takes
        self._item = None  # the latest item not yet taken
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        with self._lock:
            if self._item is not None and _is_last(self._item):
                return
            wake, self._item = self._item is None, item
        if wake:  # otherwise a wake-up is already on its way
            try:
                self.loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass

    async def get(self):
        while True:
            await self._ready.wait()
            with self._lock:
                item, self._item = self._item, None
                self._ready.clear()
            if item is not None:
                return item


def _is_last(item) -> bool:
    return isinstance(item, BaseException) or item.error is not None or item.finished


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, stall_timeout: float | None = 60.0,
                 max_sequences_per_step: int | None = None):
        """`stall_timeout` None: no stall detection. `max_sequences_per_step` defaults to four
        times the engine's max_num_seqs."""
        self.engine = engine
        self.stall_timeout = stall_timeout
        self.max_sequences_per_step = (max_sequences_per_step
                                       or 4 * engine.config.scheduler.max_num_seqs)
        # (command, request id, change to the queued sequences: +n for an add, -n for a shed)
        self._inbox: deque[tuple[Callable[[], object], str | None, int]] = deque()
        self._unadded = 0  # that change, summed over commands not yet in a published snapshot
        self._shedding = 0  # sequences being shed, not yet in a published snapshot
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # touched by both threads, one key at a time
        self._finals: dict[str, asyncio.Future] = {}  # idem: generate's `final`, until resolved
        self._stats = engine.stats()
        self._dead: BaseException | None = None
        self._stopping = False
        self._sleeping = engine.sleeping_tags  # set when a sleep is asked, before it runs
        self._busy = False  # the loop has work (set and cleared by the engine thread)
        self._heartbeat = time.monotonic()  # last step completed, or woke with work
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        self._watchdog_stop = threading.Event()
        if stall_timeout is not None:
            threading.Thread(target=self._watchdog, name="jaxserve-engine-watchdog",
                             daemon=True).start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def load_seconds(self) -> float:
        return self.engine.load_seconds

    @property
    def compile_seconds(self) -> float:
        return self.engine.compile_seconds

    def stats(self) -> EngineStats:
        return self._stats

    def replica_stats(self) -> list[EngineStats]:
        """Stats per data-parallel replica (metrics label them): this engine is one."""
        return [self._stats]

    @property
    def num_queued(self) -> int:
        """Sequences accepted and never started: waiting in the scheduler as of the last step
        (preempted ones excluded, see the module doc), plus those submitted since."""
        with self._wake:
            return self._num_queued()

    def _num_queued(self) -> int:
        return sum(self._stats.num_new_by_priority.values()) + self._unadded

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping

    @property
    def stalled_for(self) -> float:
        """Seconds since the loop last made progress while it has work (0 when idle)."""
        return time.monotonic() - self._heartbeat if self._busy else 0.0

    @property
    def is_stalled(self) -> bool:
        return self.stall_timeout is not None and self.stalled_for > self.stall_timeout

    def engine_thread_stack(self) -> str:
        """Where the engine thread is now (for logs when it hangs)."""
        frame = sys._current_frames().get(self._thread.ident)  # noqa: SLF001 - documented use
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    # ---- caller side (any asyncio loop) ------------------------------------------------------

    def admit(self, num_seqs: int, max_queued: int | None, priority: int = 0) -> None:
        """Apply the global queue limit before a request of num_seqs sequences is generated (and
        before any response bytes go out): when the queued sequences plus these pass max_queued,
        shed enough never-started sequences of less important priorities (a command the engine
        runs before its next step), or raise EngineOverloaded when there are not that many.
        Approximate by the requests admitted at the same moment, and by requests that start
        between the last snapshot and the shed (they are not shed: the queue then exceeds the
        limit until they leave it)."""
        if max_queued is None:
            return
        with self._wake:
            queued = self._num_queued()
            over = queued + num_seqs - max_queued
            if over <= 0:
                return
            sheddable = sum(c for p, c in self._stats.num_new_by_priority.items()
                            if p > priority) - self._shedding
            if sheddable < over:
                raise EngineOverloaded(f"the request queue is full ({queued} sequences wait for "
                                       f"a slot); retry later", OVERLOADED_RETRY_AFTER_S)
            self._shedding += over
            self._inbox.append((lambda: self.engine.shed(priority, over), None, -over))
            self._unadded -= over
            self._wake.notify()

    def check_fits(self, prompt_lens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """LLMEngine.check_fits (a pure check: safe from any thread)."""
        return self.engine.check_fits(prompt_lens, params)

    def prepare(self, request_id: str, prompt, params: SamplingParams | None = None,
                priority: int = 0, *, qos: QoS | None = None,
                fitted: bool = False) -> PreparedRequest:
        """Validate a request on the caller's thread (LLMEngine.prepare): the errors a client
        gets before anything is queued."""
        return self.engine.prepare(request_id, prompt, params, priority, qos=qos, fitted=fitted)

    async def generate(self, prompt=None, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, *,
                       qos: QoS | None = None, prepared: PreparedRequest | None = None,
                       final: asyncio.Future | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative), the last one finished. Leaving the loop early
        (break, cancellation, client gone) aborts the request and frees its pages. `qos`: see
        `LLMEngine.prepare`; a request that runs out of time or is shed raises (module doc).
        `prepared` (from `prepare`) replaces prompt, params, request_id, priority and qos.
        `final` (a future of the caller's loop): see the module doc."""
        try:
            if not self.is_running:
                raise EngineDead(f"the engine is not running ({self._dead or 'shut down'})")
            if prepared is None:
                prepared = self.prepare(request_id or f"req-{uuid.uuid4().hex}", prompt, params,
                                        priority, qos=qos)
            request_id = prepared.request_id
            if request_id in self._streams:
                raise InvalidRequest(f"request id {request_id!r} is already in use",
                                     "request_id")
            with self._wake:  # under sleep()'s lock: queued before its command, or refused
                if self._sleeping:
                    raise EngineOverloaded("the engine is asleep (POST /wake_up wakes it)")
                stream = self._streams[request_id] = _Stream(asyncio.get_running_loop())
                if final is not None:
                    self._finals[request_id] = final
                self._submit(lambda: self.engine.add_prepared(prepared), request_id,
                             prepared.params.n)
        except BaseException:
            resolve_final(final, None)  # it never reached the engine
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    if isinstance(item.error, JaxServeError):  # the request's own fault: typed
                        raise item.error
                    raise RequestFailed(f"request {request_id} failed: "
                                        f"{type(item.error).__name__}: {item.error}")
                finished = item.finished
                if finished and (error := _outcome_error(request_id, item)) is not None:
                    raise error
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    async def abort_sequence(self, request_id: str, index: int) -> None:
        """End sequence `index` of the request alone (LLMEngine.abort_sequence)."""
        self._submit(lambda: self.engine.abort_sequence(request_id, index))

    def _submit(self, command: Callable[[], object], request_id: str | None = None,
                sequences: int = 0) -> None:
        with self._wake:
            self._inbox.append((command, request_id, sequences))
            self._unadded += sequences
            self._wake.notify()

    # ---- sleep (LLMEngine.sleep / wake_up, run on the engine thread; call off the event loop) --

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return self._sleeping

    def sleep(self, level: int) -> None:
        """LLMEngine.sleep, blocking until done. New requests are refused (EngineOverloaded) from
        this call on; one still running makes it a Conflict."""
        with self._wake:  # every level frees the KV cache
            self._sleeping = self._sleeping | {"kv_cache"}
        try:
            self._call(lambda: self.engine.sleep(level))
        finally:
            with self._wake:
                self._sleeping = self.engine.sleeping_tags

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """LLMEngine.wake_up, blocking until done; requests are taken once nothing sleeps."""
        try:
            self._call(lambda: self.engine.wake_up(tags))
        finally:
            with self._wake:
                self._sleeping = self.engine.sleeping_tags

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine) on the engine thread between steps, awaited (its error is raised here; the
        engine goes on): the KV pages' export and import of jaxserve.core.kv_transfer."""
        return await asyncio.to_thread(self._call, lambda: fn(self.engine))

    def _call(self, fn: Callable[[], object]):
        """Run fn on the engine thread between steps and wait for it (its error is raised here;
        the engine goes on)."""
        done: Future = Future()

        def command():
            try:
                done.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
                done.set_exception(e)
        if not self.is_running:
            raise EngineDead(f"the engine is not running ({self._dead or 'shut down'})")
        self._submit(command)
        while True:
            try:
                return done.result(timeout=1.0)
            except FutureTimeout:
                if not self.is_running:  # it died or stopped before running the command
                    raise EngineDead(f"the engine is not running ({self._dead or 'shut down'})")

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop the loop; open streams end with EngineDead. False if the engine thread did not
        end within `timeout` (it is wedged in a step). A dead engine's thread is not waited for:
        after `fail` it may be stuck in a collective with a process that is gone (it is a daemon
        thread, so it does not hold the process open)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._watchdog_stop.set()
        if self._dead is not None:
            return True
        self._thread.join(timeout)
        self._drop_finals()  # a wedged thread delivers nothing more
        return not self._thread.is_alive()

    def close(self) -> None:
        """Free the engine's device memory (after `shutdown`)."""
        self.engine.close()

    def fail(self, error: EngineDead) -> None:
        """Stop serving now, from any thread: open streams end with `error`, new requests are
        refused, /ready turns 503. The first error is the one reported."""
        with self._wake:
            if self._dead is None:
                self._dead = error
            self._busy = False
            self._wake.notify()
        for stream in list(self._streams.values()):
            stream.put(self._dead)
        self._drop_finals()

    def _drop_finals(self) -> None:
        """Nothing more will be delivered: every `final` waiting resolves to None."""
        for request_id in list(self._finals):
            resolve_final(self._finals.pop(request_id, None), None)

    # ---- engine thread -----------------------------------------------------------------------

    def _has_work(self) -> bool:
        return (bool(self._inbox) or self._stopping or self._dead is not None
                or self.engine.has_unfinished())

    def _take_commands(self) -> list:
        """The inbox's oldest commands, up to max_sequences_per_step sequences (at least one
        command; an abort counts one)."""
        commands, sequences = [], 0
        while self._inbox and (not commands or sequences < self.max_sequences_per_step):
            commands.append(self._inbox.popleft())
            sequences += max(1, commands[-1][2])
        return commands

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if not self._has_work():
                        self._busy = False
                        while not self._has_work():
                            self._wake.wait()
                        self._heartbeat = time.monotonic()  # the stall clock starts with work
                        self._busy = True
                    if self._dead is not None:
                        raise self._dead
                    if self._stopping:
                        raise EngineDead("the engine was shut down")
                    commands = self._take_commands()
                for command, request_id, _ in commands:
                    try:
                        command()
                    except InvalidRequest as e:  # e.g. an id reused before its abort landed
                        self._deliver(request_id, e)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                # Stats first: whoever sees a request's final output also sees it counted.
                stats = self.engine.stats()
                with self._wake:
                    self._stats = stats
                    self._unadded -= sum(sequences for _, _, sequences in commands)
                    self._shedding += sum(sequences for _, _, sequences in commands
                                          if sequences < 0)
                    self._heartbeat = time.monotonic()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - every stream must hear of it
            if self._dead is None and not isinstance(e, EngineDead):
                log.exception("engine step failed; the engine is dead")
            self.fail(e if isinstance(e, EngineDead) else EngineDead(f"engine step failed: {e}"))

    def _watchdog(self) -> None:
        """Log a stall once when it starts (with the engine thread's stack) and once when it
        ends."""
        logged = False
        while not self._watchdog_stop.wait(min(1.0, self.stall_timeout / 4)):
            if self.is_stalled and not logged:
                s = self._stats
                log.error("engine stalled: no step completed for %.1f s while work is pending "
                          "(%d running, %d waiting, %d commands in the inbox); engine thread "
                          "stack:\n%s", self.stalled_for, s.num_running, s.num_waiting,
                          len(self._inbox), self.engine_thread_stack())
                logged = True
            elif logged and not self.is_stalled:
                log.warning("engine progressing again")
                logged = False
            if not self._thread.is_alive():
                return

    def _deliver(self, request_id: str | None, item) -> None:
        stream = self._streams.get(request_id) if request_id is not None else None
        if stream is not None:
            stream.put(item)
        if request_id is not None and _is_last(item):
            resolve_final(self._finals.pop(request_id, None),
                          item if isinstance(item, RequestOutput) else None)


def resolve_final(final: asyncio.Future | None, output: RequestOutput | None) -> None:
    """Resolve a `final` future (module doc) with `output`, from any thread, unless done."""
    if final is None:
        return

    def resolve():
        if not final.done():
            final.set_result(output)
    try:
        final.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed: nobody waits for it any more
        pass


def _outcome_error(request_id: str, out: RequestOutput) -> JaxServeError | None:
    """The typed error for a request that ended by running out of time or by being shed."""
    reasons = {c.finish_reason for c in out.outputs}
    if "deadline" in reasons:
        return DeadlineExceeded(f"request {request_id} passed its deadline")
    if "queue_timeout" in reasons:
        return QueueTimeout(f"request {request_id} waited its tenant's max_queue_time_s without "
                            f"starting; retry later", OVERLOADED_RETRY_AFTER_S)
    if "shed" in reasons:
        return EngineOverloaded(f"request {request_id} was shed from the full queue for a more "
                                f"important one; retry later", OVERLOADED_RETRY_AFTER_S)
    return None

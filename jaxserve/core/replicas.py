"""Data parallelism in one process: several engine replicas behind one front door.

Each replica is an AsyncEngine with its own scheduler, KV pool, compiled programs and thread, on
its own slice of the devices; their steps run concurrently (JAX releases the GIL while a program
runs). `ReplicaSet` is a ServingEngine (jaxserve.core.serving_engine) like AsyncEngine, so front
ends and the fleet need no data-parallel code. A request goes to the replica
`jaxserve.core.replica_routing.pick_replica` chooses: the one whose prefix cache holds the longest
prefix of the prompt, unless it is much busier than the least-loaded one. The prefix view is the
replica's live page index, read without locks (see KVCacheManager.count_cached_prefix): a hint
that may be a step stale.

All replicas share one configuration and pool size, so validating on any replica is validating
on all of them; a replica that dies takes the set out of service (`is_running` False), so /ready
answers 503 and the orchestrator replaces the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from dataclasses import fields
from typing import AsyncIterator, Sequence

from jaxserve.core.async_engine import OVERLOADED_RETRY_AFTER_S, AsyncEngine, resolve_final
from jaxserve.core.cache import extend_page_hashes
from jaxserve.core.engine import EngineStats
from jaxserve.errors import EngineDead, EngineOverloaded, InvalidRequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.replica_routing import pick_replica
from jaxserve.core.request import QoS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


class ReplicaSet:
    def __init__(self, replicas: Sequence[AsyncEngine], max_imbalance: int | None = None):
        """max_imbalance: sequences by which a replica may out-load the least-loaded one and still
        win on its cached prefix; default half a batch (max_num_seqs // 2, at least 1)."""
        if not replicas:
            raise ValueError("a ReplicaSet needs at least one replica")
        self.replicas = list(replicas)
        config = self.replicas[0].engine.config
        self.page_size = config.cache.page_size
        self.max_imbalance = max_imbalance or max(1, config.scheduler.max_num_seqs // 2)
        self._owner: dict[str, AsyncEngine] = {}  # request id -> its replica, while it streams

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    # Replicas load and compile together: the first one's times are the set's.
    @property
    def load_seconds(self) -> float:
        return self.replicas[0].load_seconds

    @property
    def compile_seconds(self) -> float:
        return self.replicas[0].compile_seconds

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def is_stalled(self) -> bool:
        """Any replica stalled (see AsyncEngine.is_stalled): its requests get nothing."""
        return any(r.is_stalled for r in self.replicas)

    def engine_thread_stack(self) -> str:
        return "\n".join(f"replica {i}:\n{r.engine_thread_stack()}"
                         for i, r in enumerate(self.replicas))

    @property
    def num_queued(self) -> int:
        return sum(r.num_queued for r in self.replicas)

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' numbers summed (num_usable_pages too: the pools of all replicas)."""
        per = self.replica_stats()
        apart = ("num_new_by_priority", "expert_tokens", "expert_parallel_size")
        total = {f.name: sum(getattr(s, f.name) for s in per) for f in fields(EngineStats)
                 if f.name not in apart}
        return EngineStats(**total, num_new_by_priority=dict(
            sum((Counter(s.num_new_by_priority) for s in per), Counter())),
            expert_tokens=tuple(map(sum, zip(*(s.expert_tokens for s in per)))),
            expert_parallel_size=per[0].expert_parallel_size)

    def admit(self, num_seqs: int, max_queued: int | None, priority: int = 0) -> None:
        """AsyncEngine.admit over the whole set: when all replicas' queued sequences plus these
        pass max_queued, the replica with the longest queue that can shed the excess (of less
        important, never-started requests) does; EngineOverloaded when none can."""
        if max_queued is None:
            return
        queued = [r.num_queued for r in self.replicas]
        over = sum(queued) + num_seqs - max_queued
        if over <= 0:
            return
        for i in sorted(range(len(self.replicas)), key=lambda i: -queued[i]):
            try:
                # Asked to take `over` sequences beyond what it holds, a replica sheds that many.
                self.replicas[i].admit(over, queued[i], priority)
                return
            except EngineOverloaded:
                continue
        raise EngineOverloaded(f"the request queue is full ({sum(queued)} sequences wait for a "
                               f"slot); retry later", OVERLOADED_RETRY_AFTER_S)

    def check_fits(self, prompt_lens: Sequence[int], params: SamplingParams) -> SamplingParams:
        return self.replicas[0].check_fits(prompt_lens, params)

    def prepare(self, request_id: str, prompt, params: SamplingParams | None = None,
                priority: int = 0, *, qos: QoS | None = None,
                fitted: bool = False) -> PreparedRequest:
        return self.replicas[0].prepare(request_id, prompt, params, priority, qos=qos,
                                        fitted=fitted)

    def route(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The index of the replica a prompt goes to (see jaxserve.core.replica_routing)."""
        # The prompt's last token is never served from the cache: it must run to sample.
        hashes = extend_page_hashes([], prompt_token_ids, self.page_size,
                                    (len(prompt_token_ids) - 1) // self.page_size, cache_salt)
        cached = [r.engine.scheduler.cache.count_cached_prefix(hashes) for r in self.replicas]
        loads = [r.num_queued + r.stats().num_running for r in self.replicas]
        return pick_replica(cached, loads, self.max_imbalance)

    async def generate(self, prompt=None, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0, *,
                       qos: QoS | None = None, prepared: PreparedRequest | None = None,
                       final: asyncio.Future | None = None) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.generate on the routed replica. Routing and submitting run without an
        await between them, so concurrent requests each see the others' load."""
        try:
            if not self.is_running:
                raise EngineDead("a data-parallel replica is not running; the server cannot "
                                 "generate")
            if prepared is None:
                prepared = self.prepare(request_id or f"req-{uuid.uuid4().hex}", prompt, params,
                                        priority, qos=qos)
            if prepared.request_id in self._owner:
                raise InvalidRequest(f"request id {prepared.request_id!r} is already in use",
                                     "request_id")
        except BaseException:
            resolve_final(final, None)
            raise
        replica = self.replicas[self.route(prepared.prompt_token_ids, prepared.qos.cache_salt)]
        self._owner[prepared.request_id] = replica
        try:
            # aclosing: a consumer that stops early must abort on the replica now, not at GC.
            async with contextlib.aclosing(replica.generate(prepared=prepared,
                                                            final=final)) as stream:
                async for out in stream:
                    yield out
        finally:
            self._owner.pop(prepared.request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await replica.abort(request_id)

    async def abort_sequence(self, request_id: str, index: int) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await replica.abort_sequence(request_id, index)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """What sleeps on any replica (a sleep that failed half-way leaves some asleep)."""
        return frozenset().union(*(r.sleeping_tags for r in self.replicas))

    def sleep(self, level: int) -> None:
        for r in self.replicas:
            r.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        for r in self.replicas:
            r.wake_up(tags)

    def shutdown(self, timeout: float = 30.0) -> bool:
        """AsyncEngine.shutdown on every replica; False if any engine thread would not end."""
        return all([r.shutdown(timeout) for r in self.replicas])

    def close(self) -> None:
        for r in self.replicas:
            r.close()

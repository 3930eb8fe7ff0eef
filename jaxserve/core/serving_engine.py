"""ServingEngine: what the serving layer, admission, the fleet and the front ends use of an engine.

Two classes implement it: AsyncEngine (one LLMEngine on its own thread) and ReplicaSet
(data-parallel AsyncEngines behind one front door); jaxserve.core.engine_factory.start_engine
returns one or the other. tests/test_serving_engine.py checks that both provide every member with
the same signature.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol, Sequence

from jaxserve.core.engine import EngineStats
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.preparation import PreparedRequest
from jaxserve.core.request import QoS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


class ServingEngine(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def load_seconds(self) -> float:
        """Reading the weights, for the start-up line."""

    @property
    def compile_seconds(self) -> float:
        """Compiling (or loading from the compilation cache) every program."""

    # ---- requests ----------------------------------------------------------------------------

    def admit(self, num_seqs: int, max_queued: int | None, priority: int = 0) -> None:
        """The queue limit, before a request of num_seqs sequences is generated: sheds less
        important never-started work, or raises EngineOverloaded."""

    def check_fits(self, prompt_lens: Sequence[int], params: SamplingParams) -> SamplingParams:
        """The request's prompts against the context and the KV pool, once; `params` with
        max_tokens fitted to the pool (a pure check, any thread)."""

    def prepare(self, request_id: str, prompt, params: SamplingParams | None = None,
                priority: int = 0, *, qos: QoS | None = None,
                fitted: bool = False) -> PreparedRequest:
        """Validate a request on the caller's thread: the errors a client gets before anything
        is queued (`fitted`: params come from check_fits over the whole request)."""

    def generate(self, prompt=None, params: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0, *,
                 qos: QoS | None = None, prepared: PreparedRequest | None = None,
                 final: asyncio.Future | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (cumulative), the last one finished. `final` receives
        the last output once the engine has ended the request, whoever stopped reading (the
        tokens computed, for usage); None when it never ran (AsyncEngine's module doc)."""

    async def abort(self, request_id: str) -> None: ...

    async def abort_sequence(self, request_id: str, index: int) -> None: ...

    # ---- state -------------------------------------------------------------------------------

    def stats(self) -> EngineStats: ...

    def replica_stats(self) -> list[EngineStats]:
        """Stats per data-parallel replica (metrics label them)."""

    @property
    def num_queued(self) -> int:
        """Sequences accepted and never started (what the admission limit reads)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def is_stalled(self) -> bool:
        """No step completed for the stall timeout while work is pending."""

    def engine_thread_stack(self) -> str:
        """Where the engine thread(s) are now (for logs when one hangs)."""

    # ---- sleep (POST /sleep, /wake_up; blocking: call off the event loop) ---------------------

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """What sleeps ("weights", "kv_cache"); empty: awake. Requests are refused while any."""

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache, level 2 also moves the weights to host memory (LLMEngine
        .sleep); refuses new requests from the call on; Conflict while a request runs."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what `tags` name (None: all)."""

    # ---- the end -----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop the loop(s); False if an engine thread did not end within `timeout`."""

    def close(self) -> None:
        """Free the device memory (weights, KV cache, programs), after `shutdown`."""

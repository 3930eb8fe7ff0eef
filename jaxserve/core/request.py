"""A request's host-side state, shared by the scheduler, the page pool and the engine.

One rule drives every step: a request computes a slice of `all_token_ids[num_computed_tokens:]`.
A prefill chunk is any such slice; a decode is the case where exactly one token is left. The request
samples a new token in a step iff that step's slice reaches the end of `all_token_ids`. Preemption
is recompute: the pages go back to the pool, `num_computed_tokens` returns to 0 (the prefix cache
may hand full pages back at readmission), and the same rule resumes where it stopped, outputs
included.

Who a request is served for travels with it (`QoS`): its priority (strict classes), its tenant and
weight (the fair share within a class), the tenant's KV page budget, and two absolute
`time.monotonic()` times: the deadline (past it the request ends wherever it is) and the queue
deadline (not started by then, it ends without generating anything).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.errors import InvalidRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"
    PREEMPTED = "preempted"  # admitted before, waiting again
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    FINISHED_DEADLINE = "finished_deadline"  # past its deadline, queued or running
    FINISHED_QUEUE_TIMEOUT = "finished_queue_timeout"  # not started by its queue deadline
    FINISHED_SHED = "finished_shed"  # displaced from a full queue by a more important request

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                       RequestStatus.FINISHED_DEADLINE, RequestStatus.FINISHED_QUEUE_TIMEOUT,
                       RequestStatus.FINISHED_SHED})


class ServiceClass(enum.IntEnum):
    """A tenant's class, as the integer priority the scheduler orders by (lower is served first,
    strictly). The default priority 0 is "standard", so the integer `priority` of `LLM` and
    `AsyncEngine` keeps its meaning: any int, lower first, classes in between."""

    INTERACTIVE = -1
    STANDARD = 0
    BATCH = 1


@dataclass(frozen=True)
class QoS:
    """How the scheduler treats a request: set by the gateway from the tenant (or left default)."""

    priority: int = ServiceClass.STANDARD
    tenant: str = "default"
    weight: float = 1.0  # share among the tenants of one priority
    kv_page_fraction: float | None = None  # of the pool; over it, the tenant's new requests wait
    deadline: float | None = None  # absolute time.monotonic()
    queue_deadline: float | None = None  # absolute time.monotonic()
    cache_salt: str | None = None  # prefix cache pages are shared only under the same salt

    def __post_init__(self):
        if not self.weight > 0:
            raise InvalidRequest(f"weight must be > 0, got {self.weight}", "weight")
        if self.kv_page_fraction is not None and not 0 < self.kv_page_fraction <= 1:
            raise InvalidRequest(f"kv_page_fraction must be in (0, 1], got "
                                 f"{self.kv_page_fraction}", "kv_page_fraction")


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still two requests
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # opaque here; the engine and the sampler read it
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value is served first, strictly (see ServiceClass)
    tenant: str = "default"  # fair share among the tenants of one priority, by tokens
    weight: float = 1.0
    kv_page_fraction: float | None = None
    deadline: float | None = None  # time.monotonic(); see QoS
    queue_deadline: float | None = None
    max_tokens: int | None = None  # output budget, reserved in the fair share until it ends
    cache_salt: str | None = None  # see QoS
    # Its prompt's logprobs are asked for: every prompt position goes through the step (no prefix
    # from the prefix cache) so the step can score it (SamplingParams.prompt_logprobs).
    scores_prompt: bool = False
    # (prompt tokens, seconds): prefixes to pin in the prefix cache once computed
    # (SamplingParams.cache_pins); the scheduler empties it as it pins them.
    cache_pins: tuple[tuple[int, float], ...] = ()
    num_cache_creation_tokens: int = 0  # prompt tokens under a pin this request made
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    page_table: list[int] = field(default_factory=list)  # owned by the KV cache manager
    status: RequestStatus = RequestStatus.WAITING
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_draft_tokens: int = 0  # speculative drafts verified for it, and how many stood
    num_accepted_draft_tokens: int = 0
    # Chained hashes of this request's full pages of token ids, in order. They depend only on the
    # tokens, which are only ever appended, so they stay valid across preemptions.
    page_hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] without building all_token_ids (long prompts, every step)."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

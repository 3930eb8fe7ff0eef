"""A request's host-side state, shared by the scheduler, the page pool and the engine.

One rule drives every step: a request computes a slice of `all_token_ids[num_computed_tokens:]`.
A prefill chunk is any such slice; a decode is the case where exactly one token is left. The request
samples a new token in a step iff that step's slice reaches the end of `all_token_ids`. Preemption
is recompute: the pages go back to the pool, `num_computed_tokens` returns to 0 (the prefix cache
may hand full pages back at readmission), and the same rule resumes where it stopped, outputs
included.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass(eq=False)  # identity semantics: two requests with equal fields are still two requests
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # opaque here; the engine and the sampler read it
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value is served first; FCFS within one priority
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    page_table: list[int] = field(default_factory=list)  # owned by the KV cache manager
    status: RequestStatus = RequestStatus.WAITING
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
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

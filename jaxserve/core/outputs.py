"""What the engine hands back, in vLLM's shape: one RequestOutput per request, holding n
CompletionOutputs whose text and token ids are cumulative (a stream's consumer takes the delta)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """The sampled token's logprob and the `logprobs` most likely (token id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]]


class PromptLogprob(NamedTuple):
    """One prompt token's log-probability given the tokens before it, its rank in that
    distribution (1 = the most likely) and the `prompt_logprobs` most likely (token id, logprob)
    pairs."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class PrefillChunk:
    """One step's slice of a sequence's prefill (or of its recompute after a preemption)."""

    start: float  # monotonic: the step was scheduled
    end: float  # monotonic: the step's tokens were sampled
    num_tokens: int


@dataclass
class RequestMetrics:
    """Monotonic-clock times of one request's life (None until they happen), and what a trace
    needs of its phases: its prefill chunks and speculative drafts, recorded as plain numbers in
    the step loop (telemetry/tracing.py turns them into spans once the request has ended)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    num_draft_tokens: int = 0  # speculative drafts verified for its sequences (set at the end)
    num_accepted_draft_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # the request failed on its own (finish_reason "abort"); the others ran on
    error: Exception | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, the first None (nothing comes
    # before it); set from the first output on (the prompt is scored by then).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # prompt tokens written under a prompt-cache pin this request made (SamplingParams.cache_pins)
    num_cache_creation_tokens: int = 0

"""The sampler's input rows: what the engine hands the executor for each sampling sequence of a
step (like BatchPlan for the forward), and the constants the sampler compiles with.

No JAX, so the host side (jaxserve.core) builds rows and validates requests against these bounds
without loading it. A request's settings are jaxserve.core.sampling_params.SamplingParams, which
has every attribute `RowParams` names.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

# Bounds the static width of the per-row "blocked ids" array the sampler masks while min_tokens
# holds back EOS and stop tokens, so that width never depends on a request.
MAX_STOP_TOKEN_IDS = 64
# Below this temperature a row is greedy: dividing logits by it would only amplify rounding.
SAMPLING_EPS = 1e-5


class RowParams(Protocol):
    """The sampling settings of a row, as the sampler reads them."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None

    @property
    def is_greedy(self) -> bool: ...

    @property
    def uses_penalties(self) -> bool: ...


class SamplingRow(NamedTuple):
    """One sampling sequence of a step. `seed` is resolved (SamplingParams.sequence_seed), so an
    unseeded request keeps one random stream across steps and preemptions."""

    params: RowParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]

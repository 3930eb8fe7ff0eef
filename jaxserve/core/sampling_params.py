"""What a request asks of sampling: SamplingParams, validated where it is built.

Host-side and free of JAX, so parsing a request never loads it. A value we cannot honour is an
InvalidRequest naming the field, never silently ignored. Stop strings, stop_token_ids, max_tokens,
ignore_eos and the structured-output constraint's end are enforced by the engine on the host;
everything that changes which token is drawn runs on the device (`jaxserve.executor.sampler`), the
constraint as a token bitmask computed on the host.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import dataclass
from typing import Any

from jaxserve.config import MAX_LOGPROBS  # the sampler's compiled top-logprobs width
from jaxserve.errors import InvalidRequest
from jaxserve.executor.sampling_rows import MAX_STOP_TOKEN_IDS, SAMPLING_EPS
from jaxserve.structured.params import StructuredOutputsParams

_SEED_RANGE = (-(2**63), 2**64)


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"'{field}' {message}", param=field)


def _int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad(field, f"must be an integer, got {type(value).__name__} {value!r:.40}")
    return int(value)


def _float(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(field, f"must be a number, got {type(value).__name__} {value!r:.40}")
    value = float(value)
    if not math.isfinite(value):
        raise _bad(field, f"must be finite, got {value}")
    return value


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(field, f"must be a boolean, got {type(value).__name__} {value!r:.40}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, in vLLM's names and defaults.

    temperature 0 means greedy (exact argmax of the penalised logits). top_k 0 or -1 and top_p 1
    turn those filters off. max_tokens None means "up to the model's context" (the engine fills it).
    logprobs None: no logprobs; k in 0..20: the sampled token's logprob plus the top k.
    prompt_logprobs None: none; k in 0..20: every prompt token's logprob (the first has none),
    its rank and the top k, as vLLM (RequestOutput.prompt_logprobs). Such a request computes its
    whole prompt itself: it takes no prefix from the prefix cache.
    structured_outputs: the output must match this constraint (grammar-constrained decoding);
    the sequence finishes with "stop" as soon as the constraint is complete.
    num_speculative_tokens: on an engine with speculative decoding, at most this many draft
    tokens per step for this request (0 opts out); None: the engine's setting.
    cache_pins: (prompt tokens, seconds) pairs: pin that prompt prefix's full pages in the prefix
    cache for that long (Anthropic's cache_control breakpoints; jaxserve.core.cache).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    num_speculative_tokens: int | None = None
    cache_pins: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if _int("n", self.n) < 1:
            raise _bad("n", f"must be at least 1, got {self.n}")
        set_("temperature", _float("temperature", self.temperature))
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        set_("top_p", _float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        set_("top_k", _int("top_k", self.top_k))
        if self.top_k < -1:
            raise _bad("top_k", f"must be -1 or 0 (off) or at least 1, got {self.top_k}")
        set_("min_p", _float("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _float(name, getattr(self, name)))
            if not -2 <= getattr(self, name) <= 2:
                raise _bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        set_("repetition_penalty", _float("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise _bad("repetition_penalty",
                       f"must be > 0 (1 is off), got {self.repetition_penalty}")
        if self.seed is not None:
            set_("seed", _int("seed", self.seed))
            if not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
                raise _bad("seed", "must fit in 64 bits")
        if self.max_tokens is not None:
            set_("max_tokens", _int("max_tokens", self.max_tokens))
            if self.max_tokens < 1:
                raise _bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        set_("min_tokens", _int("min_tokens", self.min_tokens))
        if self.min_tokens < 0:
            raise _bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                                     f"({self.max_tokens})")
        set_("stop", self._stop(self.stop))
        set_("stop_token_ids", self._stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(name, _int(name, getattr(self, name)))
                if not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                    raise _bad(name, f"must be in [0, {MAX_LOGPROBS}], got {getattr(self, name)}")
        if self.num_speculative_tokens is not None:
            set_("num_speculative_tokens",
                 _int("num_speculative_tokens", self.num_speculative_tokens))
            if self.num_speculative_tokens < 0:
                raise _bad("num_speculative_tokens",
                           f"must be >= 0 (0 opts out), got {self.num_speculative_tokens}")
        set_("cache_pins", tuple((_int("cache_pins", n), _float("cache_pins", t))
                                 for n, t in self.cache_pins))
        if any(n < 1 or not t > 0 for n, t in self.cache_pins):
            raise _bad("cache_pins", "must be (tokens >= 1, seconds > 0) pairs")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise _bad("structured_outputs", f"must be StructuredOutputsParams, got "
                                             f"{type(self.structured_outputs).__name__}")

    @staticmethod
    def _stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", f"must be a string or a list of strings, got {stop!r:.60}")
        if any(s == "" for s in stop):
            raise _bad("stop", "strings must not be empty")
        return tuple(stop)

    @staticmethod
    def _stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise _bad("stop_token_ids", f"must be a list of integers, got {ids!r:.60}")
        ids = tuple(_int("stop_token_ids", i) for i in ids)
        if any(i < 0 for i in ids):
            raise _bad("stop_token_ids", "must be non-negative token ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        return ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def uses_top_filters(self) -> bool:
        """top_k or top_p is on: the sampler needs the sorted distribution (see sample)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def sequence_seed(self, index: int = 0) -> int:
        """The seed of the index-th of the n sequences: seed + index, so n > 1 seeded sequences
        differ from each other yet repeat across runs; a fresh random seed when none was given."""
        if self.seed is None:
            return secrets.randbits(64)
        return (self.seed + index) % 2**64


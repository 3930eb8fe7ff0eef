"""A request checked once: `PreparedRequest`, what the engine's `prepare` builds before anything
runs (see LLMEngine.prepare)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.request import QoS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured.grammar import CompiledGrammar


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for `add_request` (built by `prepare`, which may run on another
    thread than the engine: it touches only the tokenizer and the configs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    qos: QoS = QoS()
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled

    @property
    def priority(self) -> int:
        return self.qos.priority

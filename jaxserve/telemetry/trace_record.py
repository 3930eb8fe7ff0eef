"""What one request's trace records while it runs: phases as plain monotonic timestamps, no
OpenTelemetry object but the request's own span, opaque here. `Tracing` (tracing.py, loaded only
with --otlp-traces-endpoint) starts a `RequestTrace` per call and turns what it holds into child
spans once the call has ended; with tracing off a call's trace is None and every recording
below is one `is None` test.

The engine's phases (queue, each prefill chunk, decode) are not recorded here: the step loop
writes them as numbers on the request's RequestMetrics (core/outputs.py) and the request's final
output hands those over (`engine_done`), so the step's hot path makes no OpenTelemetry call.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass(frozen=True)
class Phase:
    name: str  # "policy_screening", "retrieval", "grammar_compile", "admission", "shadow"
    start: float  # time.monotonic()
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)


class RequestTrace:
    """`exporter`: the Tracing that started it (its `span` and `export`); `span`: the request's
    span, parent of every phase's."""

    def __init__(self, exporter: Any, span: Any, offset_ns: int):
        self.exporter = exporter
        self.span = span
        # Wall clock minus monotonic clock, read once: every span of the request is placed by the
        # same conversion (read per span, a child at the request's arrival started before it).
        self.offset_ns = offset_ns
        self.phases: list[Phase] = []  # list.append is atomic: executor threads record too
        self.engine: list[tuple[int, Any, int]] = []  # (prompt index, RequestMetrics, tokens)
        self.attributes: dict[str, Any] = {}  # the request's own (its sampling parameters)

    def phase(self, name: str, start: float, end: float, **attributes: Any) -> None:
        self.phases.append(Phase(name, start, end, attributes))

    def engine_done(self, index: int, metrics: Any, output_tokens: int) -> None:
        """Prompt `index`'s engine request ended: its RequestMetrics (times, prefill chunks,
        drafts) and the tokens its choices produced."""
        if metrics is not None:
            self.engine.append((index, metrics, output_tokens))

    def later(self, phase: Phase) -> None:
        """A phase that ends after the request may have (a shadow copy): exported on its own,
        as a child of the request's span."""
        self.exporter.export_phase(self, phase)


@contextlib.contextmanager
def timed(trace: RequestTrace | None, name: str, **attributes: Any) -> Iterator[None]:
    """Record the block as phase `name` of `trace` (nothing when tracing is off)."""
    if trace is None:
        yield
        return
    start = time.monotonic()
    try:
        yield
    finally:
        trace.phase(name, start, time.monotonic(), **attributes)


def request_attributes(params: Any) -> dict[str, Any]:
    """OpenTelemetry GenAI attributes of a request's sampling parameters (SamplingParams)."""
    attrs = {"gen_ai.request.temperature": float(params.temperature),
             "gen_ai.request.top_p": float(params.top_p),
             "gen_ai.request.choice.count": int(params.n)}
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = int(params.seed)
    return attrs

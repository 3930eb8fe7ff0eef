"""OpenTelemetry traces over OTLP/HTTP (`--otlp-traces-endpoint`, vLLM's flag), off by default.

Only `serve --otlp-traces-endpoint URL` imports this module: without it no OpenTelemetry object
exists in the process and a call's trace is None (trace_record.py). With it, every call whose
transport starts one (HTTP generation routes, gRPC Generate) gets a span, a child of the caller's
W3C `traceparent` (and `tracestate`) when it sent one. The span starts at the call's arrival and
ends with its Outcome (the `sink`): then its children are built from what the call recorded, with
their real start and end times:

    chat {model}                     SERVER; gen_ai.* attributes (GenAI semantic conventions)
      policy_screening, retrieval, grammar_compile, admission     (entrypoints/serving)
      queue, prefill_chunk (one per engine step of the prompt), decode      (the engine's
          RequestMetrics: plain timestamps written by the step loop, no span objects there)
      shadow                         exported when the shadow copy ends, which may be later

Spans go out in batches on the SDK's own thread (BatchSpanProcessor: queue of 2048, dropped
past it rather than blocking a request); OTEL_BSP_* environment variables tune it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from jaxserve.telemetry.trace_record import Phase, RequestTrace

log = logging.getLogger("jaxserve.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()
_OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # GenAI operation names


def _epoch_ns(monotonic: float, offset_ns: int) -> int:
    return int(monotonic * 1e9) + offset_ns


class Tracing:
    """One per server: the tracer provider, its OTLP exporter, and the sink that ends spans."""

    def __init__(self, endpoint: str, service_name: str = "jaxserve", exporter=None):
        """`endpoint`: the OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces);
        `exporter`: another SpanExporter instead (tests)."""
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter if exporter is not None else OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("jaxserve")

    def start(self, headers: Mapping[str, str], arrival: float) -> RequestTrace:
        """A call's trace, its span started at `arrival` (monotonic), under the caller's
        `traceparent` / `tracestate` when `headers` (case-insensitive lookups) carry them; a
        malformed one starts a new trace, as the W3C spec asks."""
        carrier = {k: v for k in ("traceparent", "tracestate")
                   if isinstance(v := headers.get(k), str)}
        parent = _PROPAGATOR.extract(carrier)
        offset = _offset_ns()
        span = self.tracer.start_span("request", context=parent, kind=SpanKind.SERVER,
                                      start_time=_epoch_ns(arrival, offset))
        return RequestTrace(self, span, offset)

    def sink(self, outcome) -> None:
        """A Sink (entrypoints/serving/calls.py): the call's span, with its phases, ends."""
        t = getattr(outcome.ctx, "trace", None)
        if t is None:
            return
        try:
            self._end(t, outcome)
        except Exception:  # noqa: BLE001 - a trace must never fail a request or the other sinks
            log.exception("could not record the trace of %s", outcome.request_id)

    def export_phase(self, t: RequestTrace, phase: Phase) -> None:
        try:
            self._child(t, phase.name, phase.start, phase.end, phase.attributes, t.offset_ns)
        except Exception:  # noqa: BLE001 - as `sink`
            log.exception("could not record a %s span", phase.name)

    def shutdown(self) -> None:
        """Send what is queued, then stop the exporter's thread."""
        self.provider.shutdown()

    # ---- building the spans --------------------------------------------------------------------

    def _child(self, t: RequestTrace, name: str, start: float, end: float,
               attributes: dict[str, Any], offset_ns: int) -> None:
        span = self.tracer.start_span(name, context=trace.set_span_in_context(t.span),
                                      attributes=attributes,
                                      start_time=_epoch_ns(start, offset_ns))
        span.end(end_time=_epoch_ns(max(start, end), offset_ns))

    def _end(self, t: RequestTrace, o) -> None:
        offset = t.offset_ns
        for p in t.phases:
            self._child(t, p.name, p.start, p.end, p.attributes, offset)
        for index, m, output_tokens in t.engine:
            self._engine_spans(t, index, m, output_tokens, o.ended_at, offset)
        span = t.span
        operation = _OPERATIONS.get(o.kind)
        if operation is not None:
            span.update_name(f"{operation} {o.model}")
            span.set_attribute("gen_ai.operation.name", operation)
        elif o.ctx.route:
            span.update_name(o.ctx.route)
        attrs = {"gen_ai.provider.name": "jaxserve", "gen_ai.response.id": o.request_id,
                 "gen_ai.usage.input_tokens": o.prompt_tokens,
                 "gen_ai.usage.output_tokens": o.completion_tokens,
                 "jaxserve.outcome": o.status, "jaxserve.transport": o.ctx.transport,
                 "jaxserve.route": o.route, **t.attributes}
        if o.model is not None:
            attrs["gen_ai.request.model"] = o.model
        if o.version is not None:
            attrs["gen_ai.response.model"] = o.version
        if o.finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = list(o.finish_reasons)
        if o.ttft_s is not None:  # vLLM's attribute names for the request's latencies
            attrs["gen_ai.latency.time_to_first_token"] = o.ttft_s
        attrs["gen_ai.latency.e2e"] = o.total_s
        if o.cost is not None:
            attrs["jaxserve.cost_usd"] = o.cost
        if o.status_code is not None:
            attrs["http.response.status_code"] = o.status_code
        span.set_attributes(attrs)
        if o.error is not None and (o.status_code or 0) >= 500:
            span.set_attribute("error.type", type(o.error).__name__)
            span.set_status(Status(StatusCode.ERROR, o.status))
        span.end(end_time=_epoch_ns(o.ended_at, offset))

    def _engine_spans(self, t: RequestTrace, index: int, m, output_tokens: int, ended: float,
                      offset: int) -> None:
        """queue, prefill_chunk..., decode of prompt `index`'s engine request."""
        prompt = {"jaxserve.prompt_index": index}
        finished = m.finished_time or ended
        self._child(t, "queue", m.arrival_time, m.first_scheduled_time or finished, prompt,
                    offset)
        for i, c in enumerate(m.prefill_chunks):
            self._child(t, "prefill_chunk", c.start, c.end,
                        {**prompt, "jaxserve.chunk_index": i,
                         "jaxserve.prefill.num_tokens": c.num_tokens}, offset)
        if m.first_token_time is not None:
            attrs = {**prompt, "gen_ai.usage.output_tokens": output_tokens,
                     "jaxserve.spec_decode.num_draft_tokens": m.num_draft_tokens,
                     "jaxserve.spec_decode.num_accepted_tokens": m.num_accepted_draft_tokens}
            if m.num_draft_tokens:
                attrs["jaxserve.spec_decode.acceptance_rate"] = (
                    m.num_accepted_draft_tokens / m.num_draft_tokens)
            self._child(t, "decode", m.first_token_time, finished, attrs, offset)


def _offset_ns() -> int:
    """Wall clock minus monotonic clock, now: phases are timed on the monotonic clock."""
    return time.time_ns() - time.monotonic_ns()

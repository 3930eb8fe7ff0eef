"""The one admission path every transport's requests take, after the body is parsed and tokenized
once (openai_serving): the engine's checks of each prompt (`prepare_requests`: empty,
vocabulary, its grammar compiled), then, on the event loop, the tenant's limits (gateway: 429),
the engine's queue (503, or a less important request shed in its place), and the QoS (class,
share, deadlines) stamped on each prepared request (`admit`).

`CallContext` is what a transport reads from its own framing once and hands over with the body:
who calls (HTTP `Authorization`, gRPC metadata `authorization`, the batch runner's --tenant), the
deadline asked (X-Request-Timeout, the gRPC call's deadline) and when the call arrived.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.serving_engine import ServingEngine
from jaxserve.gateway import Admission, Gateway, Principal
from jaxserve.telemetry.trace_record import RequestTrace


@dataclass(frozen=True)
class CallContext:
    # None only for a call refused before its key was accepted (a 401): what its audit record
    # is written from.
    principal: Principal | None
    timeout_s: float | None = None  # None: only the tenant's request_timeout_s bounds it
    arrival: float = field(default_factory=time.monotonic)
    transport: str = "http"  # "http" | "grpc" | "batch", for the access log
    client: str | None = None  # the caller's address, for the audit log
    route: str | None = None  # the HTTP path it came by; None: derived from transport and kind
    # Its trace (telemetry/trace_record.py) when the server exports traces; None: no tracing.
    trace: RequestTrace | None = field(default=None, compare=False, repr=False)


def tenant_params(principal: Principal, params: SamplingParams,
                  max_tokens_given: bool) -> SamplingParams:
    """max_tokens under the tenant's max_tokens_cap: a larger one asked for is a 400; one left
    to the server (filled from the context and the KV pool) is cut to the cap."""
    cap = principal.tenant.max_tokens_cap
    if max_tokens_given:
        principal.tenant.max_tokens(params.max_tokens)
    elif cap is not None and params.max_tokens > cap:
        params = params.replace(max_tokens=cap)
    return params


def prepare_requests(engine: ServingEngine, request_ids: Sequence[str],
                     prompt_ids: Sequence[list[int]], params: SamplingParams) -> list:
    """One PreparedRequest per prompt: the engine's checks of each prompt, and its grammar
    compiled (`prepare`), which may take a second, so a constrained request runs this off the
    event loop. It takes nothing from the tenant or the engine's queue: a client that leaves
    while it runs leaves nothing behind. `params` come from the engine's check_fits over all
    the prompts, so no prompt is fitted again. Raises InvalidRequest (400)."""
    return [engine.prepare(rid, {"prompt_token_ids": ids}, params, fitted=True)
            for rid, ids in zip(request_ids, prompt_ids)]


def admit(engine: ServingEngine, gateway: Gateway, ctx: CallContext, prepared: Sequence,
          max_queued: int | None) -> tuple[Admission, list]:
    """(the tenant's Admission, the prepared requests carrying its QoS). Called on the event
    loop with nothing awaited between it and the Generation that settles it (review H3: an
    admission taken in an executor outlived a caller that left while it ran). Raises, having
    taken nothing from the tenant's limits, RateLimitExceeded (429) or EngineOverloaded (503).
    The caller settles the Admission on every terminal path."""
    params = prepared[0].params  # the same for every prompt
    admission = gateway.admit(ctx.principal, [len(p.prompt_token_ids) for p in prepared],
                              params.max_tokens, params.n, ctx.timeout_s, ctx.arrival)
    try:
        # Before a stream's headers go out, so a full queue is a 503, never an error in a 200.
        engine.admit(len(prepared) * params.n, max_queued, admission.qos.priority)
    except BaseException:
        admission.settle(0)
        raise
    return admission, [dataclasses.replace(p, qos=admission.qos) for p in prepared]

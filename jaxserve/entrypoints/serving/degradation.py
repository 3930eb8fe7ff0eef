"""What a route's degradation (fleet/degrade.py) did to one request: its completion capped, and
the reasons its response (x-jaxserve-degraded), its usage and audit records and
jaxserve:requests_degraded_total name ("max_tokens", "version"); none: served as asked."""

from __future__ import annotations

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.fleet.degrade import MAX_TOKENS, VERSION, Degradation

HEADER = "x-jaxserve-degraded"


def degrade(degradation: Degradation | None, params: SamplingParams
            ) -> tuple[SamplingParams, tuple[str, ...]]:
    """(params under the degradation's cap, the reasons the request was degraded). A cap at or
    above what the request would get anyway changes nothing and is no reason."""
    if degradation is None:
        return params, ()
    reasons = [VERSION] if degradation.moved_from is not None else []
    cap = degradation.max_tokens
    if cap is not None and params.max_tokens > cap:
        params = params.replace(max_tokens=cap)
        reasons.append(MAX_TOKENS)
    return params, tuple(sorted(reasons))


def headers(reasons: tuple[str, ...]) -> dict[str, str]:
    return {HEADER: ",".join(reasons)} if reasons else {}

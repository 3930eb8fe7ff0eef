"""The service level indicators, defined once: the metric names the server exports for them, and
what makes an event good or bad. The Prometheus rules `jaxserve slo rules` writes (slo/rules.py)
read these names, and the fleet's canary gate classifies a request with `availability` too, so an
alert and a rollback judge a request alike.

Every SLI series carries `model_name` (the version), `route` and `tier` (the tenant's scheduling
class: interactive, standard, batch; "none" for a call whose key was refused).

- availability: `jaxserve:sli_requests_total{result}`, result "good" (answered), "bad" (a 5xx:
  an error, a shed 503, a deadline 504) or "excluded" (a 4xx, the client's own doing, or a
  client that left);
- latency: `jaxserve:sli_time_to_first_token_seconds` and `jaxserve:sli_inter_token_latency_
  seconds`, histograms whose bucket bounds (LATENCY_BUCKETS) are the thresholds an SLO may name;
- stream completion: `jaxserve:sli_streams_started_total` (an SSE stream's 200 went out) and
  `jaxserve:sli_streams_completed_total` (it then reached a terminal event: every choice
  finished and `[DONE]` was sent, or its client left); started and never completed is bad,
  including a stream that hangs.
"""

from __future__ import annotations

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)

REQUESTS = "jaxserve:sli_requests"  # a Counter: exported as REQUESTS + "_total"
TTFT = "jaxserve:sli_time_to_first_token_seconds"
ITL = "jaxserve:sli_inter_token_latency_seconds"
STREAMS_STARTED = "jaxserve:sli_streams_started"
STREAMS_COMPLETED = "jaxserve:sli_streams_completed"
LABELS = ("model_name", "route", "tier")

GOOD, BAD, EXCLUDED = "good", "bad", "excluded"


def availability(status_code: int | None) -> str:
    """A call's availability event by the status it was answered with (None: its client left)."""
    if status_code is None or 400 <= status_code < 500:
        return EXCLUDED
    return BAD if status_code >= 500 else GOOD


def stream_completed(status: str) -> bool:
    """Whether a started stream reached a terminal event, by its outcome (errors.outcome)."""
    return status in ("ok", "client_disconnected")

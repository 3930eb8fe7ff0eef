"""A call's one end, whatever its transport and however it ends: `Call.end` hands the call's one
`Outcome` (outcome.py) to each of its sinks, once.

- tenant settlement: the hold on the tenant's limits (a generation's `Admission`, or the `Lease`
  of a call beside generation) settles with the tokens used (`Lease.settle`);
- the fleet: the version's lease ends, with the outcome in its counters and its route's canary
  window when the request ran on it (`Lease.finish`), else released with its shadow copies;
- the server's `Sinks`: the request counters (`ServerMetrics.record_request`), the access log
  (a line per request that ran), the audit log and the policy counters (`RequestPolicy.record`).

The transport creates the Call (the HTTP front door, the gRPC service, the batch runner per line)
and ends it unless the serving layer did: a refusal there, or the request's Generation.
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from jaxserve.errors import version_fault
from jaxserve.fleet.versions import Lease as VersionLease
from jaxserve.telemetry import sli
from jaxserve.entrypoints.serving.outcome import Outcome

access_log = logging.getLogger("jaxserve.access")

Sink = Callable[[Outcome], None]


def metrics_sink(metrics) -> Sink:
    """`metrics`: a ServerMetrics. A request that ran counts its latency and usage under its
    version and route; any other call its outcome and the tokens an encoder read (as its audit
    record does), with no version (""). Every call counts in the SLIs (telemetry/sli.py)."""
    def count(o: Outcome) -> None:
        tenant = o.tenant or "none"
        metrics.record_sli(o.version or "", o.route, o.tier, o.status_code, o.status, o.ttft_s,
                           o.streamed)
        if not o.served:
            metrics.record_request(tenant, o.status, o.prompt_tokens, o.completion_tokens)
            return
        metrics.e2e.labels(o.version, o.route).observe(o.total_s)
        for reason in o.degraded:
            metrics.degraded.labels(o.version, o.route, o.tier, reason).inc()
        metrics.record_request(tenant, o.status, o.prompt_tokens, o.completion_tokens,
                               o.cost or 0.0, o.version, o.route)
    return count


def access_log_sink(log_prompts: bool) -> Sink:
    """One JSON line per request that ran; with `log_prompts` its prompts too (off by default:
    prompts may hold what users keep private), PII redacted by the tenant's pack."""
    def log(o: Outcome) -> None:
        if not o.served:
            return
        record = {
            "request_id": o.request_id, "model": o.version, "route": o.route, "kind": o.kind,
            "transport": o.ctx.transport, "tenant": o.tenant, "key_id": o.key_id,
            "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens, "ttft_s": o.ttft_s, "total_s": round(o.total_s, 4),
            "finish_reasons": sorted({r for r in o.finish_reasons if r}), "status": o.status}
        if o.degraded:
            record["degraded"] = list(o.degraded)
        if log_prompts:
            record["prompt"] = (o.prompts if o.screening is None else
                                [o.screening.redact_pii(t) for t in o.screening.prompt_texts])
        access_log.info(json.dumps(record))
    return log


class Sinks:
    """The server's sinks, in order; `add` installs one more (the server installs its own the
    same way)."""

    def __init__(self, metrics=None, policy=None, log_prompts: bool = False):
        """`metrics`: a ServerMetrics or None; `policy`: a RequestPolicy or None (no policy
        counters, no audit log)."""
        self._sinks: list[Sink] = []
        if metrics is not None:
            self.add(metrics_sink(metrics))
        self.add(access_log_sink(log_prompts))
        if policy is not None:
            self.add(policy.record)

    def add(self, sink: Sink) -> None:
        self._sinks.append(sink)

    def record(self, o: Outcome) -> None:
        for sink in self._sinks:
            sink(o)


def _end_version_lease(lease: VersionLease, o: Outcome) -> None:
    if o.served:  # a version's fault (a 5xx) counts against it; a client's or a shed does not
        lease.finish(error=version_fault(o.error), ttft=o.ttft_s, prompt_tokens=o.prompt_tokens,
                     completion_tokens=o.completion_tokens, cached_tokens=o.cached_tokens,
                     availability=sli.availability(o.status_code))
    else:  # it never ran there: released, with its shadow copies, saying nothing of the version
        lease.__exit__(None, None, None)


class Call:
    """One call of any transport, ended exactly once."""

    def __init__(self, sinks: Sinks):
        self.sinks = sinks
        self.outcome: Outcome | None = None
        # its Generation is ending it: waiting for the engine's last output, which may outlast
        # the transport's handler (a client that left)
        self.ending = False

    @property
    def ended(self) -> bool:
        """Ended, or being ended by its Generation: nobody else ends it."""
        return self.outcome is not None or self.ending

    def end(self, o: Outcome, *, tenant_hold=None, version_lease: VersionLease | None = None
            ) -> None:
        """`tenant_hold`: the call's hold on its tenant's limits (an Admission, or a gateway
        Lease), if it took one; `version_lease`: the fleet's lease of the version chosen."""
        if self.outcome is not None:
            raise RuntimeError(f"call {self.outcome.request_id} already ended")
        self.outcome = o
        if tenant_hold is not None:
            tenant_hold.settle(o.used_tokens)
        if version_lease is not None:
            _end_version_lease(version_lease, o)
        self.sinks.record(o)

"""The server's content policy and audit log, applied to each request: the tenant's pack's input
rules on the parsed request (before it is tokenized), its output filter on each choice as it
streams (screening.py), and, when the call ends, its policy counters and one audit record (the
audit sink of its Outcome). Host-side: no JAX.

OpenAIServing holds one `RequestPolicy` (None without --policy and --audit-log: requests then
pay nothing); each admitted Generation holds its request's `Screening`.

Which pack: a tenant's `policy`; a tenant without one (and the open server's `default` tenant)
gets the pack named `default` when the file has one, else no filtering. A tenant naming a pack
the file lacks, or any pack at all without --policy, is an error at start: a tenant promised a
policy is never served without it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from jaxserve.audit import AuditBacklogFull, AuditError, AuditLog, AuditLogConfig, AuditRecord
from jaxserve.errors import ConfigError, ContentPolicyViolation
from jaxserve.gateway.tenants import Tenant
from jaxserve.safety import Intervention, Pack, PolicySet, load_policy
from jaxserve.entrypoints.serving.outcome import Outcome
from jaxserve.entrypoints.serving.screening import (Screening, pii_redactions, prompt_texts,
                                                    with_prompt_texts)

log = logging.getLogger(__name__)


def route_of(ctx, kind: str) -> str:
    """A generation's audit record `route`: the HTTP path, "grpc:Generate", or "batch:<url>"."""
    if ctx.route is not None:
        return ctx.route
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"http": path, "grpc": "grpc:Generate"}.get(ctx.transport, f"{ctx.transport}:{path}")


def _pack(policy: PolicySet | None, tenant: Tenant) -> Pack | None:
    """The tenant's pack (see the module); ConfigError for a pack the file lacks or a pack
    named with no policy file."""
    if policy is None:
        if tenant.policy is not None:
            raise ConfigError(f"tenant {tenant.name!r} names the policy pack "
                              f"{tenant.policy!r} but no --policy file was given")
        return None
    if tenant.policy is not None:
        return policy.pack(tenant.policy)
    return policy.packs.get("default")


class RequestPolicy:
    """The policy file's packs, the audit log and the policy counters of one server (or batch)."""

    def __init__(self, policy: PolicySet | None, audit: AuditLog | None,
                 metrics=None, tenants: Iterable[Tenant] = ()):
        self.policy = policy
        self.audit = audit
        self.metrics = metrics  # a server.metrics.PolicyMetrics, or None (batch)
        for tenant in tenants:  # every tenant's pack must exist: an error at start
            self.pack_for(tenant)
        self._pii = {name: pii_redactions(pack) for name, pack in
                     (policy.packs.items() if policy is not None else ())}

    @classmethod
    def open(cls, policy_file: str | None, audit: AuditLogConfig | None, metrics=None,
             tenants: Iterable[Tenant] = ()) -> "RequestPolicy | None":
        """From the flags; None when neither is given. ConfigError / AuditError at start."""
        if policy_file is None and audit is None:
            for tenant in tenants:  # a tenant naming a pack: ConfigError
                _pack(None, tenant)
            return None
        policy = load_policy(policy_file) if policy_file is not None else None
        try:
            log_ = AuditLog(audit) if audit is not None else None
            try:
                return cls(policy, log_, metrics, tenants)
            except BaseException:
                if log_ is not None:
                    log_.close()
                raise
        except BaseException:
            if policy is not None:
                policy.close()
            raise

    def pack_for(self, tenant: Tenant) -> Pack | None:
        return _pack(self.policy, tenant)

    async def screen(self, parsed, tenant: Tenant, decode: Callable[[list[int]], str]):
        """(the parsed request as the model may see it, its Screening). Raises
        ContentPolicyViolation (400) when an input rule blocks it, AuditBacklogFull (503) while
        the audit log cannot keep up. The input interventions are counted here, blocked or not."""
        if self.audit is not None:
            self.audit.check_accepting()
        chat = parsed.kind == "chat"
        texts = prompt_texts(parsed, decode)
        pack = self.pack_for(tenant)
        interventions: tuple[Intervention, ...] = ()
        if pack is not None:
            decision = await pack.check_input(texts, tenant.name)
            interventions = decision.interventions
            if self.metrics is not None:
                self.metrics.record(interventions)
            if decision.blocked is not None:
                raise ContentPolicyViolation(decision.blocked.rule,
                                             "messages" if chat else "prompt", interventions)
            try:
                parsed = with_prompt_texts(parsed, texts, decision.texts)
            except ValueError:  # a redaction that a tool (call) does not survive: blocked
                rule = next(i.rule for i in interventions if i.action == "redact")
                raise ContentPolicyViolation(rule, "messages", interventions) from None
            texts = decision.texts
        screening = Screening(pack, interventions, texts,
                              self._pii.get(pack.name, ()) if pack is not None else (),
                              self.audit is not None and tenant.audit_content,
                              lambda token_id: decode([token_id]))
        return parsed, screening

    def record(self, o: Outcome) -> None:
        """A call ended (the audit sink, calls.Sinks): the policy's later interventions on it
        counted, its audit record queued (never blocks). A refusal nobody can be held to (no
        principal: a 401, the throttle's 429; or the audit log's own 503) is only counted in its
        client's `refusals` summary (audit/refusals.py), so a flood cannot fill the disk."""
        if not o.audited:
            return
        screening = o.screening
        if screening is not None and self.metrics is not None:
            self.metrics.record(screening.later_interventions)
        if self.audit is None:
            return
        if o.ctx.principal is None or isinstance(o.error, AuditBacklogFull):
            self.audit.count_refusal(o.ctx.client, o.tenant, o.status, route_of(o.ctx, o.kind),
                                     o.key_id)
            return
        tenant = o.ctx.principal.tenant if o.ctx.principal is not None else None
        interventions = (screening.interventions if screening is not None
                         else getattr(o.error, "interventions", ()))
        prompt = outputs = None
        if tenant is not None and tenant.audit_content and screening is not None:
            prompt = [screening.redact_pii(t) for t in screening.prompt_texts]
            outputs = [screening.redact_pii("".join(screening.outputs.get(i, ())))
                       for i in range(len(o.finish_reasons))]
        status = o.status
        record = AuditRecord(
            o.request_id, route_of(o.ctx, o.kind), status, o.status_code, o.tenant, o.key_id,
            o.model, o.version, o.ctx.client, time.time() - (time.monotonic() - o.ctx.arrival),
            o.prompt_tokens, o.completion_tokens, o.cost, o.finish_reasons, tuple(interventions),
            deadline_exceeded=status == "deadline", shed=status == "shed",
            idempotent_replay=o.idempotent_replay, cached=o.cached, prompt=prompt,
            outputs=outputs, cached_tokens=o.cached_tokens, degraded=o.degraded)
        try:
            self.audit.write(record)
        except AuditError as e:  # closed: a request that outlived the shutdown's drain
            log.error("audit record of %s lost: %s", o.request_id, e)

    def check_accepting(self) -> None:
        """AuditBacklogFull (a 503) while the audit log cannot take another record."""
        if self.audit is not None:
            self.audit.check_accepting()

    def close(self) -> None:
        """Flush the audit log (every queued record written and synced) and stop the
        classifiers."""
        if self.audit is not None:
            self.audit.close()
        if self.policy is not None:
            self.policy.close()


"""The server's content policy and audit log, applied to each request: the tenant's pack's input
rules on the parsed request (before it is tokenized), its output filter on each choice as it
streams, and, when the request ends, its policy counters and one audit record. Host-side: no JAX.

OpenAIServing holds one `RequestPolicy` (None without --policy and --audit-log: requests then
pay nothing); each admitted Generation holds its request's `Screening`.

Which pack: a tenant's `policy`; a tenant without one (and the open server's `default` tenant)
gets the pack named `default` when the file has one, else no filtering. A tenant naming a pack
the file lacks, or any pack at all without --policy, is an error at start: a tenant promised a
policy is never served without it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from jaxserve.audit import AuditError, AuditLog, AuditLogConfig, AuditRecord
from jaxserve.errors import ConfigError, ContentPolicyViolation, error_status, outcome
from jaxserve.gateway.keys import presented_key_id
from jaxserve.gateway.tenants import Tenant
from jaxserve.safety import Intervention, Pack, PolicySet, Rule, TextFilter, load_policy
from jaxserve.entrypoints.serving.protocol import new_id

log = logging.getLogger(__name__)


def route_of(ctx, kind: str) -> str:
    """A generation's audit record `route`: the HTTP path, "grpc:Generate", or "batch:<url>"."""
    if ctx.route is not None:
        return ctx.route
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    return {"http": path, "grpc": "grpc:Generate"}.get(ctx.transport, f"{ctx.transport}:{path}")


def _pii_rules(pack: Pack) -> tuple[Rule, ...]:
    """The pack's PII detectors as redactions, whatever their own action: what logs and audit
    content are cleaned with."""
    return tuple(dataclasses.replace(r, action="redact", stage="both") for r in pack.rules
                 if r.match.startswith("pii:"))


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


class Screening:
    """One request under its tenant's pack: the input stage's interventions and the prompt texts
    as the model saw them, one output filter per choice, and (with the tenant's audit_content)
    the text each choice was sent."""

    def __init__(self, pack: Pack | None, input_interventions: Sequence[Intervention],
                 prompt_texts: Sequence[str], pii_rules: Sequence[Rule], keep_content: bool):
        self.pack = pack
        self.input_interventions = tuple(input_interventions)
        self.prompt_texts = tuple(prompt_texts)
        self._pii_rules = tuple(pii_rules)
        self._filtering = pack is not None and pack.has_output_rules
        self._filters: dict[int, TextFilter] = {}
        self.retrieval_interventions: list[Intervention] = []
        self._held: dict[int, tuple[list, list]] = {}  # per choice: token ids, logprobs
        self.outputs: dict[int, list[str]] | None = {} if keep_content else None

    def output(self, choice: int, text_so_far: str, new_text: str, ids: list, logprobs,
               final: bool) -> tuple[str, list, list | None, bool]:
        """One choice's delta through its output filter: (text, token ids, logprobs) that may
        be sent, and whether a block rule ended the choice. Token ids and logprobs wait while
        the filter holds text back (they would spell it), and those of a blocked term are
        never sent."""
        blocked = False
        if self._filtering:
            f = self._filters.get(choice)
            if f is None:
                f = self._filters[choice] = self.pack.output_filter()
            result = f.update(text_so_far, final)
            new_text, blocked = result.text, result.blocked is not None
            held_ids, held_lps = self._held.setdefault(choice, ([], []))
            held_ids.extend(ids)
            held_lps.extend(logprobs or ())
            if blocked or f.position < len(text_so_far):
                ids, logprobs = [], None if logprobs is None else []
            else:
                ids, logprobs = held_ids[:], None if logprobs is None else held_lps[:]
            if blocked or f.position == len(text_so_far):
                held_ids.clear()
                held_lps.clear()
        if self.outputs is not None and new_text:
            self.outputs.setdefault(choice, []).append(new_text)
        return new_text, ids, logprobs, blocked

    def screen_chunks(self, results: list) -> list:
        """Retrieved chunks (rag.SearchResult) through the input text rules: a chunk a block
        rule matches is dropped from the context (prompt injection through a document), others
        are redacted; each rule that acted is recorded with stage "retrieval"."""
        if self.pack is None:
            return results
        kept = []
        for r in results:
            text, found, blocked = self.pack.check_text(r.text)
            self.retrieval_interventions.extend(
                dataclasses.replace(i, stage="retrieval") for i in found)
            if blocked is None:
                kept.append(dataclasses.replace(r, text=text))
        return kept

    @property
    def later_interventions(self) -> list[Intervention]:
        """Those of the request's processing after admission: retrieval, then each choice's."""
        return [*self.retrieval_interventions,
                *(i for f in self._filters.values() for i in f.interventions)]

    @property
    def interventions(self) -> list[Intervention]:
        return [*self.input_interventions, *self.later_interventions]

    def redact_pii(self, text: str) -> str:
        if not self._pii_rules:
            return text
        return TextFilter(self._pii_rules, "input", len(text) + 1).update(text, final=True).text


class RequestPolicy:
    """The policy file's packs, the audit log and the policy counters of one server (or batch)."""

    def __init__(self, policy: PolicySet | None, audit: AuditLog | None,
                 metrics=None, tenants: Iterable[Tenant] = ()):
        self.policy = policy
        self.audit = audit
        self.metrics = metrics  # a server.metrics.PolicyMetrics, or None (batch)
        for tenant in tenants:  # every tenant's pack must exist: an error at start
            self.pack_for(tenant)
        self._pii = {name: _pii_rules(pack) for name, pack in
                     (policy.packs.items() if policy is not None else ())}

    @classmethod
    def open(cls, policy_file: str | None, audit_dir: str | None, metrics=None,
             tenants: Iterable[Tenant] = ()) -> "RequestPolicy | None":
        """From the flags; None when neither is given. ConfigError / AuditError at start."""
        if policy_file is None and audit_dir is None:
            for tenant in tenants:  # a tenant naming a pack: ConfigError
                _pack(None, tenant)
            return None
        policy = load_policy(policy_file) if policy_file is not None else None
        try:
            audit = AuditLog(AuditLogConfig(Path(audit_dir))) if audit_dir is not None else None
            try:
                return cls(policy, audit, metrics, tenants)
            except BaseException:
                if audit is not None:
                    audit.close()
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
        # A chat has one prompt (its messages); only text content is checked.
        texts = ([m["content"] for m in parsed.prompts[0] if isinstance(m.get("content"), str)]
                 if chat else [p if isinstance(p, str) else decode(p) for p in parsed.prompts])
        pack = self.pack_for(tenant)
        interventions: tuple[Intervention, ...] = ()
        if pack is not None:
            decision = await pack.check_input(texts)
            interventions = decision.interventions
            if self.metrics is not None:
                self.metrics.record(interventions)
            if decision.blocked is not None:
                raise ContentPolicyViolation(decision.blocked.rule,
                                             "messages" if chat else "prompt", interventions)
            parsed = _with_texts(parsed, texts, decision.texts)
            texts = decision.texts
        screening = Screening(pack, interventions, texts,
                              self._pii.get(pack.name, ()) if pack is not None else (),
                              self.audit is not None and tenant.audit_content)
        return parsed, screening

    def record(self, *, request_id: str, kind: str, ctx, error: BaseException | None,
               model: str | None, version: str | None = None, prompt_tokens: int = 0,
               completion_tokens: int = 0, cost: float | None = None,
               finish_reasons: Sequence[str] = (), screening: Screening | None = None,
               idempotent_replay: bool = False, key_id: str | None = None,
               status_code: int = 200) -> None:
        """A request ended (or was refused, or replayed: screening None): its later
        interventions counted, its audit record queued (never blocks). `version`: the model
        version that answered (None: none was chosen). A call refused before its key was
        accepted has no principal: its tenant is null and `key_id` is that of the key it sent.
        `status_code`: that of a success (201 for a created collection)."""
        if screening is not None and self.metrics is not None:
            self.metrics.record(screening.later_interventions)
        if self.audit is None:
            return
        principal = ctx.principal
        tenant = principal.tenant if principal is not None else None
        if principal is not None:
            key_id = principal.key_id
        interventions = (screening.interventions if screening is not None
                         else getattr(error, "interventions", ()))
        prompt = outputs = None
        if tenant is not None and tenant.audit_content and screening is not None:
            prompt = [screening.redact_pii(t) for t in screening.prompt_texts]
            outputs = [screening.redact_pii("".join(screening.outputs.get(i, ())))
                       for i in range(len(finish_reasons))]
        status = outcome(error)
        code = (status_code if error is None else
                None if status == "client_disconnected" else error_status(error).http)
        record = AuditRecord(
            request_id, route_of(ctx, kind), status, code,
            tenant.name if tenant is not None else None, key_id, model, version, ctx.client,
            time.time() - (time.monotonic() - ctx.arrival), prompt_tokens, completion_tokens,
            cost, tuple(finish_reasons), tuple(interventions),
            deadline_exceeded=status == "deadline", shed=status == "shed",
            idempotent_replay=idempotent_replay, prompt=prompt, outputs=outputs)
        try:
            self.audit.write(record)
        except AuditError as e:  # closed: a request that outlived the shutdown's drain
            log.error("audit record of %s lost: %s", request_id, e)

    def check_accepting(self) -> None:
        """AuditBacklogFull (a 503) while the audit log cannot take another record."""
        if self.audit is not None:
            self.audit.check_accepting()

    def record_call(self, ctx, error: BaseException | None, authorization: str | None,
                    prompt_tokens: int = 0, status_code: int = 200) -> None:
        """The audit record of a call no Generation records: a call that is not a generation
        (embeddings, rerank, tokenize, collections, gRPC Embed; `prompt_tokens`: the tokens
        the encoder read, `status_code`: its success status), or a request refused before
        the serving layer saw it (a bad or missing key, a body that is not JSON, too large or
        too deep, an Idempotency-Key conflict), with what is known: no model or version;
        without a principal (a 401) the tenant is null and the key id is that of the key sent
        (`authorization`)."""
        self.record(request_id=new_id("req"), kind="", ctx=ctx, error=error, model=None,
                    prompt_tokens=prompt_tokens, key_id=presented_key_id(authorization),
                    status_code=status_code)

    def close(self) -> None:
        """Flush the audit log (every queued record written and synced) and stop the
        classifiers."""
        if self.audit is not None:
            self.audit.close()
        if self.policy is not None:
            self.policy.close()


def _with_texts(parsed, before: Sequence[str], after: Sequence[str]):
    """`parsed` with its prompt texts replaced by their redacted versions; a token-id prompt
    whose text a redaction changed becomes the redacted text (tokenized again)."""
    if list(before) == list(after):
        return parsed
    if parsed.kind == "chat":
        it = iter(after)
        messages = [{**m, "content": next(it)} if isinstance(m.get("content"), str) else m
                    for m in parsed.prompts[0]]
        return dataclasses.replace(parsed, prompts=[messages])
    prompts = [p if b == a else a for p, b, a in zip(parsed.prompts, before, after)]
    return dataclasses.replace(parsed, prompts=prompts)

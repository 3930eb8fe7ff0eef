"""Which generation requests the response cache (gateway/response_cache.py) answers, under which
key, and how a cached answer is sent again.

- **Cacheable**: a chat or text completion whose output is fixed by the request: temperature 0
  or a `seed` given. Never a request with a server-side tool (a chat's `rag`: the collection it
  searches changes), nor one its tenant keeps out (the tenant's `response_cache = false`), nor
  one whose caller says `Cache-Control: no-store`. `Cache-Control: no-cache` runs the request
  (no cached answer) and keeps its answer for the next one.
- **Key**: the tenant, the answering version (name and manifest id) and the canonical request:
  the parsed request after the version's defaults and the tenant's input policy, as sorted
  compact JSON (so `0` and `0.0`, field order or a default written out give one key), hashed.
- **Kept**: an answer sent in full with no policy intervention (a filtered or redacted answer is
  the policy's to decide each time) and every choice ended by `stop`, or by `length` at the
  request's own max_tokens: a completion cut shorter (a max_tokens filled from what the context
  or the KV pool held, the tenant's cap, a route's degradation under overload) depends on more
  than the request.
- **Replayed**: the body or the SSE events as first sent, with a new `id` and `created` (each
  answer has its own, as OpenAI's do) and `usage.cost` 0 (no compute: the tenant pays nothing
  for a hit); the token counts stay those of the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxserve.fleet.versions import Lease
from jaxserve.gateway.response_cache import CachedAnswer, ResponseCache
from jaxserve.entrypoints.serving import protocol


def cache_control(value: str | None) -> tuple[bool, bool]:
    """(read, write) from a Cache-Control request header (RFC 9111 request directives):
    no-cache: do not answer from the cache; no-store: neither answer from it nor keep the
    answer. Other directives are ignored, as the RFC asks."""
    directives = {d.strip().split("=", 1)[0].lower() for d in (value or "").split(",")}
    no_store = "no-store" in directives
    return not (no_store or "no-cache" in directives), not no_store


@dataclass
class CacheUse:
    """One request's use of the cache: what its caller and tenant allow, and after the lookup
    its `status` (the x-jaxserve-cache header: "hit", "miss" or "bypass") and `key`."""

    cache: ResponseCache
    read: bool = True
    write: bool = True
    status: str = "bypass"
    key: bytes | None = field(default=None, repr=False)

    def lookup(self, parsed: protocol.ParsedRequest, tenant, lease: Lease
               ) -> CachedAnswer | None:
        """The cached answer of `parsed` on the version `lease` chose, or None (then `status`
        says whether its answer will be kept: "miss", or "bypass" for one never cached)."""
        if not (tenant.response_cache and (self.read or self.write) and cacheable(parsed)):
            self.status = "bypass"
            return None
        self.key = request_key(tenant.name, lease.version.name, lease.version.fingerprint,
                               parsed)
        answer = self.cache.get(self.key) if self.read else None
        self.status = "hit" if answer is not None else "miss"
        return answer

    def keeper(self, gen) -> Callable[[Any], None] | None:
        """What stores a miss's answer (`gen`, its Generation) once it was sent in full (an
        idempotency Keep's shape: it receives the StoredResponse); None when nothing is to be
        kept. The answer's finish reasons and interventions are read then."""
        if self.status != "miss" or not self.write:
            return None
        key, parsed = self.key, gen.parsed
        # `length` at the request's own max_tokens, not at one the server chose or cut
        own_length = parsed.max_tokens_given \
            and gen.params.max_tokens == parsed.sampling_params.max_tokens

        def keep(stored) -> None:
            reasons = tuple(gen.finish_reasons.get(i, "") for i in range(gen.num_choices))
            clean = gen.screening is None or not gen.screening.interventions
            if clean and all(r == "stop" or (r == "length" and own_length) for r in reasons):
                self.cache.put(key, CachedAnswer(stored.body, stored.events, gen.version.name,
                                                 gen.route, reasons, gen.degraded))
        return keep


def cacheable(parsed: protocol.ParsedRequest) -> bool:
    params = parsed.sampling_params
    return parsed.rag is None and (params.temperature == 0 or params.seed is not None)


def request_key(tenant: str, version: str, manifest_id: str | None,
                parsed: protocol.ParsedRequest) -> bytes:
    canonical = json.dumps({"tenant": tenant, "version": version, "manifest": manifest_id,
                            "request": dataclasses.asdict(parsed)},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).digest()


def replayed(answer: CachedAnswer, answer_id: str) -> CachedAnswer:
    """The answer as a hit sends it: `answer_id` and a new created, usage.cost 0."""
    changes = {"id": answer_id, "created": protocol.now()}
    if answer.body is not None:
        return dataclasses.replace(answer, body=_rewritten(answer.body, changes))
    return dataclasses.replace(answer, events=tuple(_event(e, changes) for e in answer.events))


def _rewritten(payload: bytes, changes: dict) -> bytes:
    doc = json.loads(payload)
    doc.update(changes)
    usage = doc.get("usage")
    if isinstance(usage, dict) and "cost" in usage:
        usage["cost"] = 0.0
    return json.dumps(doc, separators=(",", ":")).encode()


def _event(event: bytes, changes: dict) -> bytes:
    """One SSE event (an optional `event:` line, then one `data:` line: JSON has no raw
    newline) with its JSON data rewritten; [DONE] as it is."""
    *head, data = event.rstrip(b"\n").split(b"\n")
    if not data.startswith(b"data: ") or data == b"data: [DONE]":
        return event
    return b"\n".join([*head, b"data: " + _rewritten(data[len(b"data: "):], changes)]) + b"\n\n"

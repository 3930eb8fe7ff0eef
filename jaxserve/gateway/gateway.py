"""`Gateway`: the tenants, their keys and their limiters, behind the calls a transport makes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from jaxserve.errors import Unauthenticated
from jaxserve.gateway.auth_throttle import AuthThrottle
from jaxserve.gateway.budgets import Budgets
from jaxserve.gateway.deadlines import request_qos
from jaxserve.gateway.keys import Principal, authenticate
from jaxserve.gateway.limits import Lease, TenantLimiter
from jaxserve.gateway.tenants import Tenants, open_tenants
from jaxserve.core.request import QoS


@dataclass
class Admission:
    """An admitted request: its QoS for the engine and its hold on the tenant's limits."""

    principal: Principal
    qos: QoS
    lease: Lease

    def settle(self, used_tokens: int) -> None:
        """Call on every terminal path (done, error, cancelled): the unused reservation goes back
        and the concurrency slot frees. Later calls do nothing."""
        self.lease.settle(used_tokens)


class Gateway:
    def __init__(self, tenants: Tenants | None = None,
                 clock: Callable[[], float] = time.monotonic, auth_failures_per_minute: int = 0):
        self.tenants = tenants if tenants is not None else open_tenants()
        self._clock = clock
        self.auth_throttle = AuthThrottle(auth_failures_per_minute, 60.0, clock=clock)
        self._limiters = {name: TenantLimiter(t, clock) for name, t in self.tenants.tenants.items()}
        self.budgets = Budgets(self.tenants.tenants.values())  # wall clock: UTC days, months

    def authenticate(self, authorization: str | None, client: str | None = None) -> Principal:
        """The `Authorization` header's tenant: Unauthenticated (401) if unknown or missing;
        RateLimitExceeded (429), before the key is checked, while `client` (an address) is
        over its failed authentications (auth_throttle.py; None: not throttled)."""
        if client is None:
            return authenticate(self.tenants, authorization)
        self.auth_throttle.check(client)
        try:
            return authenticate(self.tenants, authorization)
        except Unauthenticated:
            self.auth_throttle.failed(client)
            raise

    def check(self, principal: Principal, model: str) -> None:
        """The edge checks, before the body is tokenized: ModelNotFound (404) for a model the
        tenant may not use, QuotaExceeded (429 insufficient_quota) when its spending budget is
        spent, RateLimitExceeded (429) when no request could pass now."""
        principal.tenant.check_model(model)
        self.budgets.check(principal.tenant)
        self._limiters[principal.tenant.name].check()

    def refused(self, principal: Principal) -> None:
        """A request of the tenant's was refused (400, 404, 429) after its body was read: it
        costs one request of requests_per_minute as an admitted one does (review M8: refusals
        were free, so a tenant could repeat expensive ones without end)."""
        self._limiters[principal.tenant.name].refused()

    def admit(self, principal: Principal, prompt_tokens: Sequence[int], max_tokens: int,
              n: int = 1, timeout_s: float | None = None,
              arrival: float | None = None) -> Admission:
        """Admission, once the prompts are tokenized: `prompt_tokens` is each prompt's length,
        `max_tokens` the resolved completion budget of each sequence (already capped with
        `Tenant.max_tokens`), n the choices per prompt, timeout_s the X-Request-Timeout header
        (or the gRPC deadline), arrival when the request came in (monotonic; default now: the
        deadlines count from it). Reserves prompt + max_tokens per sequence on the tenant's
        buckets (RateLimitExceeded, 429, taking nothing, when they cannot), and gives the QoS."""
        num_seqs = len(prompt_tokens) * n
        lease = self._limiters[principal.tenant.name].acquire(
            sum(prompt_tokens) + num_seqs * max_tokens, num_seqs)
        arrival = self._clock() if arrival is None else arrival
        return Admission(principal, request_qos(principal.tenant, arrival, timeout_s), lease)

    def admit_call(self, principal: Principal, *, tokens: bool, holds_slot: bool) -> Lease:
        """A call that is not a generation, under the same limits: one request from
        requests_per_minute; with `holds_slot`, one of max_concurrent_requests until settled (work
        in an executor: embeddings, retrieval); with `tokens` (an encoder's input, known once it
        has read it), one token reserved now, so a bucket in debt refuses the call, and the rest
        taken by `settle(tokens read)`. RateLimitExceeded (429) having taken nothing."""
        return self._limiters[principal.tenant.name].acquire(int(tokens), int(holds_slot))

    def headers(self, principal: Principal) -> dict[str, str]:
        """x-ratelimit-* for the tenant, for every response."""
        return self._limiters[principal.tenant.name].headers()

"""A tenant's limits: token buckets refilled continuously, and a concurrency limit.

- requests_per_minute: a bucket of that many requests, refilled at limit/60 per second; each
  admitted API request takes one, and so does each refused one (`refused`; never into debt).
- tokens_per_minute: a bucket of that many tokens; admission reserves the request's prompt tokens
  plus max_tokens for each of its sequences (OpenAI counts the same way), and its end settles the
  reservation with the tokens really used (the unused part goes back; a use beyond the reservation
  is taken then, and may leave the bucket in debt, which the tenant's next requests wait out).
- max_concurrent_requests: sequences admitted and not ended (queued + running; n > 1 counts n).

A call that is not a generation (tokenize, embeddings, retrieval) is admitted the same way with
what it knows up front: no sequence or one slot, no token or one (an encoder call reads at least
that); its end settles with the tokens it used, which may be more than it reserved.

`check` is the cheap edge test (nothing consumed, before the body is tokenized); `acquire`
decides at admission, all or nothing, and returns a `Lease` that the request's end settles.
A refusal is RateLimitExceeded with `retry_after`, the seconds until the same request would pass
(None when it never can: it is larger than the bucket). `headers` gives OpenAI's
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` values for every response.

The buckets are a few lines of arithmetic on an injected clock rather than a rate-limit library:
the ones on PyPI (`limits`, `pyrate-limiter`, `aiolimiter`) have no way to hand back an unused
reservation, and read the wall clock themselves.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from jaxserve.errors import RateLimitExceeded
from jaxserve.gateway.tenants import Tenant

# Retry-After for the concurrency limit: a slot frees when one of the tenant's requests ends,
# which no bucket predicts.
CONCURRENCY_RETRY_AFTER_S = 1.0


class TokenBucket:
    """`capacity` tokens, refilled continuously at `rate` per second. Starts full."""

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = capacity
        self.rate = rate
        self._level = capacity
        self._at = now

    def level(self, now: float) -> float:
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = max(self._at, now)
        return self._level

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0: now; inf: never, it is over the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level(now)) / self.rate)

    def take(self, amount: float, now: float) -> None:
        self._level = self.level(now) - amount

    def give_back(self, amount: float, now: float) -> None:
        self._level = min(self.capacity, self.level(now) + amount)

    def until_full(self, now: float) -> float:
        return (self.capacity - self.level(now)) / self.rate


def per_minute(limit: int | None, now: float) -> TokenBucket | None:
    return None if limit is None else TokenBucket(limit, limit / 60.0, now)


class TenantLimiter:
    def __init__(self, tenant: Tenant, clock: Callable[[], float] = time.monotonic):
        self.tenant = tenant
        self._clock = clock
        now = clock()
        self._requests = per_minute(tenant.requests_per_minute, now)
        self._tokens = per_minute(tenant.tokens_per_minute, now)
        self._in_flight = 0  # sequences admitted and not settled
        self._lock = threading.Lock()

    def check(self) -> None:
        """The edge test: would a request with one sequence and one token pass now? Consumes
        nothing; `acquire` decides."""
        with self._lock:
            self._refusal(1, 1, self._clock())

    def refused(self) -> None:
        """A refused request takes one request from the bucket, as far as it holds one: the
        bucket never goes into debt for refusals, which a refused tenant then waits out."""
        with self._lock:
            if self._requests is not None:
                now = self._clock()
                self._requests.take(min(1.0, max(0.0, self._requests.level(now))), now)

    def acquire(self, tokens: int, num_seqs: int) -> "Lease":
        """Admit a request that reserves `tokens` and runs `num_seqs` sequences, or raise
        RateLimitExceeded having taken nothing."""
        with self._lock:
            now = self._clock()
            self._refusal(tokens, num_seqs, now)
            if self._requests is not None:
                self._requests.take(1, now)
            if self._tokens is not None:
                self._tokens.take(tokens, now)
            self._in_flight += num_seqs
        return Lease(self, tokens, num_seqs)

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (limits the tenant does not have are left out)."""
        out = {}
        with self._lock:
            now = self._clock()
            for kind, bucket in (("requests", self._requests), ("tokens", self._tokens)):
                if bucket is not None:
                    out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                    out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(bucket.level(now))))
                    out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.until_full(now))
        return out

    def _refusal(self, tokens: int, num_seqs: int, now: float) -> None:
        t = self.tenant
        # What can never pass first: retrying it is pointless.
        if self._tokens is not None and tokens > self._tokens.capacity:
            raise RateLimitExceeded(
                f"Request too large for tokens per minute: limit {t.tokens_per_minute}, "
                f"requested {tokens} (prompt + max_tokens for each choice). Please reduce "
                f"max_tokens or the prompt.", None, "max_tokens")
        cap = t.max_concurrent_requests
        if cap is not None and num_seqs > cap:
            raise RateLimitExceeded(f"The request runs {num_seqs} sequences but this API key may "
                                    f"run at most {cap} at once.", None, "n")
        if self._requests is not None and (wait := self._requests.wait(1, now)) > 0:
            raise RateLimitExceeded(
                f"Rate limit reached for requests: limit {t.requests_per_minute} per minute. "
                f"Please try again in {format_duration(wait)}.", wait)
        # A call reserving no token (tokenize) is not held back by a bucket in debt.
        if self._tokens is not None and tokens and (wait := self._tokens.wait(tokens, now)) > 0:
            raise RateLimitExceeded(
                f"Rate limit reached for tokens per minute: limit {t.tokens_per_minute}, "
                f"requested {tokens}. Please try again in {format_duration(wait)}.", wait)
        if cap is not None and self._in_flight + num_seqs > cap:
            raise RateLimitExceeded(
                f"Too many concurrent requests: limit {cap} sequences queued or running, "
                f"{self._in_flight} now. Please try again when one ends.",
                CONCURRENCY_RETRY_AFTER_S)

    def _settle(self, lease: "Lease", used_tokens: int) -> None:
        with self._lock:
            if self._tokens is not None and used_tokens < lease.tokens:
                self._tokens.give_back(lease.tokens - used_tokens, self._clock())
            elif self._tokens is not None and used_tokens > lease.tokens:
                self._tokens.take(used_tokens - lease.tokens, self._clock())
            self._in_flight -= lease.num_seqs


class Lease:
    """One admitted request's hold on its tenant's limits, until `settle` (once; later calls do
    nothing, so every terminal path may call it)."""

    def __init__(self, limiter: TenantLimiter, tokens: int, num_seqs: int):
        self._limiter = limiter
        self.tokens = tokens
        self.num_seqs = num_seqs
        self.settled = False
        self._lock = threading.Lock()
        self._work: Future | None = None  # executor work under way that the lease waits for
        self._work_tokens: Callable[[Any], int] = lambda result: 0
        self._ended: int | None = None  # the call's own settle, while its work still ran

    def hold_for(self, work: Future, used_tokens: Callable[[Any], int]) -> None:
        """Executor work the call started (one at a time; threads cannot be stopped): a settle
        before it ends waits for it, then takes the larger of its own tokens and those the work
        read (`used_tokens(result)`). So a client that leaves neither frees its slot nor skips
        paying while its work runs on."""
        with self._lock:
            self._work, self._work_tokens = work, used_tokens
        work.add_done_callback(self._work_done)

    def settle(self, used_tokens: int) -> None:
        """The request ended having used `used_tokens` (prompt + completion, all choices; the
        tokens an encoder read)."""
        with self._lock:
            if self.settled:
                return
            if self._work is not None:
                self._ended = used_tokens
                return
            self.settled = True
        self._limiter._settle(self, used_tokens)

    def _work_done(self, work: Future) -> None:
        read = 0 if work.cancelled() or work.exception() else self._work_tokens(work.result())
        with self._lock:
            self._work = None
            if self._ended is None or self.settled:  # the call goes on: its end settles
                return
            used, self.settled = max(self._ended, read), True
        self._limiter._settle(self, used)


def format_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: "20ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + f"{m}m{s}s"


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110); round up so a retry then passes."""
    return str(max(1, math.ceil(seconds)))

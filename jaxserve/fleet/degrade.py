"""Graceful degradation on a route: under overload, the lower classes get less before anyone is
shed. A route's `degrade` table names the classes it may degrade (never interactive) and what they
get: `max_tokens` (a cap on their completion) and/or `degrade_to` (a smaller version answers).

Overload is read from the signals the shedding already uses, on the engine of the version the
request would go to, at selection: its queued sequences reaching `queue_fraction` of the server's
shedding threshold (--max-queued-requests: past it, admission sheds or answers 503), or, when the
route sets `kv_usage`, the fraction of its KV pages held by live requests reaching that. Degrading
happens below the shedding threshold, so shedding stays the last step. Host-side: no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxserve.core.request import ServiceClass

# The classes a route may degrade: interactive traffic never is.
DEGRADABLE = tuple(c.name.lower() for c in ServiceClass if c > ServiceClass.INTERACTIVE)
# Why a response was degraded (x-jaxserve-degraded, the `reason` label, usage and audit records).
MAX_TOKENS, VERSION = "max_tokens", "version"


@dataclass(frozen=True)
class DegradeConfig:
    classes: tuple[str, ...] = ("batch",)  # sorted, among DEGRADABLE
    max_tokens: int | None = None  # the cap on a degraded request's completion
    degrade_to: str | None = None  # the version a degraded request goes to
    queue_fraction: float = 0.5  # of --max-queued-requests, in (0, 1)
    kv_usage: float | None = None  # KV pages in use / usable, in (0, 1]; None: not a signal

    def applies(self, priority: int) -> bool:
        """Whether a request of this class (ServiceClass value) may be degraded."""
        return any(ServiceClass[c.upper()] == priority for c in self.classes)

    def queue_threshold(self, max_queued: int) -> int:
        """Queued sequences from which the version counts as overloaded (at most the shedding
        threshold itself, for a threshold of 1)."""
        return max(1, math.ceil(self.queue_fraction * max_queued))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "classes": list(self.classes)}


@dataclass(frozen=True)
class Degradation:
    """What selection decided for one request: its completion cap (None: none) and the version
    the route would have sent it to (None: it was not moved); `signal` is why ("queue",
    "kv_cache")."""

    signal: str
    max_tokens: int | None = None
    moved_from: str | None = None


def overload(config: DegradeConfig, engine, max_queued: int | None) -> str | None:
    """The overload signal `engine` (a ServingEngine) shows now, or None."""
    if max_queued is not None and engine.num_queued >= config.queue_threshold(max_queued):
        return "queue"
    if config.kv_usage is not None:
        s = engine.stats()
        if s.num_usable_pages and s.pages_in_use / s.num_usable_pages >= config.kv_usage:
            return "kv_cache"
    return None

"""The automatic canary gate: per route, each version's recent requests in a sliding window, and
the comparison of every non-incumbent version with the incumbent on error rate, TTFT p99 and cost
per 1k tokens. A version over its ratio on any of them trips (the fleet then sets its weight to 0).
With an `availability_objective`, a version also trips on its own when the availability SLI the
SLO alerts read (telemetry/sli.py: 5xx bad, 4xx and clients gone left out) burns its error budget
faster than `max_burn_rate` over the window: the burn rate that pages rolls the canary back.

"Healthy on latency but 2x the cost" fails the cost criterion: cost is compared per 1k tokens from
each version's own price, so a dearer model trips `max_cost_ratio` however fast it answers.
Host-side: no JAX.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from jaxserve.fleet.routing import Route
from jaxserve.telemetry import sli


@dataclass(frozen=True)
class Sample:
    time: float
    error: bool
    ttft: float | None  # seconds; None when no token came
    tokens: int  # prompt + completion
    cost: float | None  # USD; None when the version has no price
    availability: str = sli.GOOD  # its availability SLI event: good, bad or excluded


@dataclass(frozen=True)
class WindowStats:
    requests: int
    errors: int
    error_rate: float
    ttft_p99: float | None
    cost_per_1k_tokens: float | None
    sli_error_ratio: float | None = None  # bad / (good + bad) availability events; None: none

    def to_dict(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate,
                "ttft_p99_seconds": self.ttft_p99, "cost_per_1k_tokens": self.cost_per_1k_tokens,
                "sli_error_ratio": self.sli_error_ratio}


@dataclass(frozen=True)
class Trip:
    route: str
    version: str
    reason: str  # "error_rate" | "ttft_p99" | "cost_per_1k_tokens" | "availability_burn_rate"
    value: float
    incumbent_value: float
    limit_ratio: float

    def message(self) -> str:
        # For the burn rate, incumbent_value is the version's error budget, not the incumbent's.
        base = ("its error budget" if self.reason == "availability_burn_rate"
                else "the incumbent's")
        return (f"canary gate: route {self.route!r} version {self.version!r} {self.reason} "
                f"{self.value:.4g} exceeds {self.limit_ratio:g}x {base} "
                f"{self.incumbent_value:.4g}; its weight is now 0")


def window_stats(samples: deque[Sample]) -> WindowStats:
    n = len(samples)
    errors = sum(s.error for s in samples)
    ttfts = [s.ttft for s in samples if not s.error and s.ttft is not None]
    priced = [s for s in samples if not s.error and s.cost is not None]
    tokens = sum(s.tokens for s in priced)
    bad = sum(s.availability == sli.BAD for s in samples)
    counted = bad + sum(s.availability == sli.GOOD for s in samples)
    return WindowStats(
        n, errors, errors / n if n else 0.0,
        float(np.percentile(ttfts, 99)) if ttfts else None,
        1000.0 * sum(s.cost for s in priced) / tokens if tokens else None,
        bad / counted if counted else None)


class CanaryMonitor:
    """The windows of one route's versions. Not thread-safe: the fleet calls it under its lock."""

    def __init__(self, max_samples: int = 10_000):
        self._max_samples = max_samples
        self._windows: dict[str, deque[Sample]] = {}

    def record(self, version: str, sample: Sample) -> None:
        window = self._windows.get(version)
        if window is None:
            window = self._windows[version] = deque(maxlen=self._max_samples)
        window.append(sample)

    def stats(self, version: str, now: float, window_seconds: float) -> WindowStats:
        window = self._windows.get(version, deque())
        while window and window[0].time < now - window_seconds:
            window.popleft()
        return window_stats(window)

    def forget(self, version: str) -> None:
        """Drop a version's samples (once it tripped, so re-enabling it starts a fresh window)."""
        self._windows.pop(version, None)

    def evaluate(self, route: Route, now: float) -> list[Trip]:
        """The route's non-incumbent versions with traffic that breach a criterion (one trip
        each, the first criterion breached)."""
        gate = route.canary
        if gate is None:
            return []
        base = self.stats(gate.incumbent, now, gate.window_seconds)
        if base.requests < gate.min_requests:
            return []
        trips = []
        for version, weight in route.weights:
            if version == gate.incumbent or weight <= 0:
                continue
            s = self.stats(version, now, gate.window_seconds)
            if s.requests < gate.min_requests:
                continue
            if gate.availability_objective is not None and s.sli_error_ratio is not None:
                budget = 1.0 - gate.availability_objective
                if s.sli_error_ratio > gate.max_burn_rate * budget:
                    trips.append(Trip(route.name, version, "availability_burn_rate",
                                      s.sli_error_ratio, budget, gate.max_burn_rate))
                    continue
            checks = (("error_rate", s.error_rate, max(base.error_rate, gate.min_error_rate),
                       gate.max_error_rate_ratio),
                      ("ttft_p99", s.ttft_p99, base.ttft_p99, gate.max_ttft_p99_ratio),
                      ("cost_per_1k_tokens", s.cost_per_1k_tokens, base.cost_per_1k_tokens,
                       gate.max_cost_ratio))
            for reason, value, incumbent, ratio in checks:
                if ratio is not None and value is not None and incumbent is not None \
                        and value > ratio * incumbent:
                    trips.append(Trip(route.name, version, reason, value, incumbent, ratio))
                    break
        return trips

"""Routes: which version answers a request sent to a route's name.

A Route is immutable; changing one means swapping in a new object, so a reader that took a route
sees all of one setting or all of the other, never half. Choosing is a pure function of the route
and a number in [0, 1): a random one, or a stable hash of the user or API key (sticky), so one user
keeps one version while the weights stay the same. Host-side: no JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable

from jaxserve.fleet.breaker import BreakerConfig
from jaxserve.fleet.degrade import DegradeConfig

STICKY_MODES = ("user", "api_key", "none")


@dataclass(frozen=True)
class CanaryGate:
    """Per-route automatic gate: a non-incumbent version whose windowed metric exceeds `ratio` x
    the incumbent's gets weight 0 (a criterion whose ratio is None is off)."""

    incumbent: str
    window_seconds: float = 300.0
    min_requests: int = 20  # in the window, for both versions, before judging
    max_error_rate_ratio: float | None = 2.0
    min_error_rate: float = 0.01  # the incumbent's rate is at least this when comparing
    max_ttft_p99_ratio: float | None = 2.0
    max_cost_ratio: float | None = 1.5  # cost per 1k tokens, from each version's price
    # The SLO's page, as an absolute criterion: a version whose share of bad events by the
    # availability SLI (telemetry/sli.py) over the window exceeds max_burn_rate x its error
    # budget (1 - availability_objective) trips, whatever the incumbent does. None: off.
    availability_objective: float | None = None
    max_burn_rate: float = 14.4  # the fast-burn page's rate for a 30-day period

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Route:
    name: str
    weights: tuple[tuple[str, float], ...]  # (version, weight), sorted by version name
    sticky: str = "none"
    shadow: tuple[tuple[str, float], ...] = ()  # (version, fraction in [0, 1]), sorted
    canary: CanaryGate | None = None
    breaker: BreakerConfig | None = None  # per-version circuit breakers (fleet/breaker.py)
    eval_gate: str | None = None  # an eval suite a version must pass before its weight grows
    degrade: DegradeConfig | None = None  # graceful degradation under overload (fleet/degrade.py)

    def weight(self, version: str) -> float:
        return dict(self.weights).get(version, 0.0)

    def with_weight(self, version: str, weight: float) -> "Route":
        weights = dict(self.weights)
        weights[version] = weight
        return dataclasses.replace(self, weights=tuple(sorted(weights.items())))

    def names(self, version: str) -> bool:
        """Whether the route sends this version traffic (a non-zero weight or shadow fraction, or
        degraded requests)."""
        return (self.weight(version) > 0 or dict(self.shadow).get(version, 0.0) > 0
                or (self.degrade is not None and self.degrade.degrade_to == version))

    def to_dict(self) -> dict:
        return {"name": self.name, "weights": dict(self.weights), "sticky": self.sticky,
                "shadow": dict(self.shadow),
                "canary": self.canary.to_dict() if self.canary is not None else None,
                "breaker": self.breaker.to_dict() if self.breaker is not None else None,
                "gate": {"eval": self.eval_gate} if self.eval_gate is not None else None,
                "degrade": self.degrade.to_dict() if self.degrade is not None else None}


def sticky_unit(route: str, key: str) -> float:
    """A stable number in [0, 1) for (route, key): the same in every process and run (Python's
    hash() is salted per process, so it would move users on every restart)."""
    digest = hashlib.sha256(f"{route}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def choose(route: Route, unit: float, eligible: Callable[[str], bool]) -> str | None:
    """The version whose cumulative-weight interval holds `unit`, among the eligible versions with
    a positive weight (in name order, so reordering the weights never moves a user)."""
    candidates = [(v, w) for v, w in route.weights if w > 0 and eligible(v)]
    total = sum(w for _, w in candidates)
    if not candidates:
        return None
    point, acc = unit * total, 0.0
    for version, w in candidates:
        acc += w
        if point < acc:
            return version
    return candidates[-1][0]  # unit * total rounded up to total


def shadows(route: Route, primary: str, draws: Iterable[float],
            eligible: Callable[[str], bool]) -> tuple[str, ...]:
    """The shadow versions this request also goes to: each independently at its fraction (one
    draw per shadow entry, in order), never the version that answers."""
    return tuple(v for (v, fraction), u in zip(route.shadow, draws)
                 if v != primary and u < fraction and eligible(v))

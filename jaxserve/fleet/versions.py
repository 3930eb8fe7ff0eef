"""A version's life (loading -> ready <-> sleeping; ready -> draining -> unloaded, or failed), its
counters, and the lease a request holds on it while it runs, so that draining knows when the last
one finished. Host-side: no JAX (the engine is whatever the loader made)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jaxserve.core.serving_engine import ServingEngine
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.gateway.pricing import Pricing

if TYPE_CHECKING:
    from jaxserve.fleet.degrade import Degradation
    from jaxserve.fleet.manifest import Manifest
    from jaxserve.fleet.memory import MemoryPlan


class VersionState(str, enum.Enum):
    LOADING = "loading"  # admitted, memory promised; weights loading and programs compiling
    READY = "ready"  # takes traffic
    SLEEPING = "sleeping"  # takes none; KV cache freed (and weights in host memory): POST /sleep
    DRAINING = "draining"  # takes no new requests; unloads when the last in-flight one ends
    UNLOADED = "unloaded"  # memory freed
    FAILED = "failed"  # loading raised; `error` says why


@dataclass
class Counters:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    shadow_requests: int = 0
    shadow_errors: int = 0
    shadow_compared: int = 0  # greedy shadow answers compared with their primary
    shadow_token_agreement_sum: float = 0.0
    canary_trips: int = 0

    def add(self, other: "Counters") -> "Counters":
        return Counters(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other))))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        agreement = d.pop("shadow_token_agreement_sum")
        d["shadow_token_agreement"] = (agreement / self.shadow_compared if self.shadow_compared
                                       else None)
        return d


@dataclass(eq=False)
class Version:
    spec: VersionSpec
    memory: "MemoryPlan"
    pricing: Pricing | None
    state: VersionState = VersionState.LOADING
    engine: ServingEngine | None = None  # while READY or DRAINING (a test's fake, in tests)
    manifest: "Manifest | None" = None
    error: str | None = None
    load_seconds: float | None = None
    compile_seconds: float | None = None
    in_flight: int = 0
    sleeping: tuple[str, ...] = ()  # what sleeps ("kv_cache", "weights"), while SLEEPING
    changing: bool = False  # a sleep or wake is under way

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def fingerprint(self) -> str | None:
        """The manifest id: OpenAI's `system_fingerprint` of this version's answers."""
        return self.manifest.id if self.manifest is not None else None

    @property
    def generation_defaults(self) -> dict:
        return dict(self.spec.generation)

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.spec.model, "state": self.state.value,
                "system_fingerprint": self.fingerprint, "error": self.error,
                "in_flight": self.in_flight, "sleeping": list(self.sleeping),
                "memory": self.memory.to_dict(),
                "load_seconds": self.load_seconds, "compile_seconds": self.compile_seconds,
                "settings": self.spec.to_dict(),
                "pricing": self.pricing.to_dict() if self.pricing is not None else None,
                "manifest": self.manifest.to_dict() if self.manifest is not None else None}


@dataclass(eq=False)
class Lease:
    """One request's hold on a version, from selection until `finish` (or leaving a `with`).

    `shadows` are the versions this request is also copied to (each its own lease; their answers
    are never sent to the client). A lease must end exactly once."""

    # The Fleet that granted it (jaxserve.fleet.fleet, which imports this module): its _finish
    # and _release end the lease.
    fleet: Any
    route: str | None  # None: the version was addressed by name
    version: Version
    shadow: bool = False
    shadows: tuple["Lease", ...] = ()
    done: bool = field(default=False, init=False)
    probe: bool = field(default=False, init=False)  # a half-open circuit breaker's probe
    # Set by the route's degradation under overload (fleet/degrade.py); None: served as asked.
    degradation: "Degradation | None" = field(default=None, init=False)

    def finish(self, *, error: bool = False, ttft: float | None = None, prompt_tokens: int = 0,
               completion_tokens: int = 0, token_agreement: float | None = None,
               availability: str = "good", cached_tokens: int = 0) -> None:
        """Record the outcome (a version's fault: `error`; a client's bad input or disconnect is
        not) and release the version. `token_agreement`: for a greedy shadow, the fraction of
        its tokens equal to the primary's; `availability`: the request's availability SLI event
        (telemetry/sli.py), for the canary gate's burn-rate criterion; `cached_tokens`: of the
        prompt tokens, those read from the prefix cache (priced at the cached rate)."""
        self.fleet._finish(self, error=error, ttft=ttft, prompt_tokens=prompt_tokens,
                           completion_tokens=completion_tokens, token_agreement=token_agreement,
                           availability=availability, cached_tokens=cached_tokens)

    def release(self) -> None:
        """End without an outcome (the request never ran, or its end says nothing about the
        version)."""
        self.fleet._release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        for lease in (self, *self.shadows):
            if not lease.done:
                lease.release()

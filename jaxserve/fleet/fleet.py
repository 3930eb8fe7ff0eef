"""The Fleet: model versions (one engine each) and the routes between them, changed at run time.

- **Load** (`load`): the version is checked and its memory planned at once (a version that does
  not fit is an InsufficientMemory before anything is allocated); weights load and every program
  compiles on the fleet's loading thread, one version at a time; only then is it `ready`.
- **Routes** are immutable objects swapped under a lock (`set_route`, `rollback`, the canary
  gate): a request selects under the same lock, so it sees one whole setting, and a version
  routed to is always ready. `rollback` swaps the current and previous settings (a second
  rollback re-applies what the first undid).
- **Select** (`select`): a route name picks a version by weight (sticky: a stable hash of the
  user or API key) plus its shadow copies; a version name addresses that version. The Lease the
  caller gets counts the request in flight until it finishes.
- **Unload** (`unload`): refused while a route sends the version traffic; else the version drains
  (no new requests, in-flight ones finish) and then its memory is freed.
- **Canary gate**: each finished routed request enters its route's window; a non-incumbent version
  breaching its ratio gets weight 0 at once, logged and counted.
- **Circuit breakers** (a route's `breaker`, fleet/breaker.py): a version whose faults pass the
  threshold, or whose engine stalls, gets none of the route's traffic until a probe answers.
- **Degradation** (a route's `degrade`, fleet/degrade.py): under overload, a request of a class
  the route may degrade is moved to `degrade_to` and/or capped (`Lease.degradation`), below the
  shedding threshold (`max_queued_requests`), so shedding stays the last step.
- **Sleep** (`sleep`, `wake_up`): a version no route sends traffic to frees its KV cache (and
  moves its weights to host memory) once its requests end, keeping its compiled programs: a warm
  standby that `wake_up` makes ready again without loading or compiling anything.

Thread-safe: the admin API, request handlers and the loading and draining threads all call in.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from jaxserve.core.serving_engine import ServingEngine
from jaxserve.errors import (AlreadyExists, ConfigError, Conflict, EngineOverloaded,
                             InvalidRequest, ModelNotFound, NotFound, TokenizerError, WeightsError)
from jaxserve.fleet.breaker import Breaker
from jaxserve.fleet.canary import CanaryMonitor, Sample, Trip
from jaxserve.fleet.degrade import Degradation, overload
from jaxserve.fleet.deployment import VersionSpec, load_deployment
from jaxserve.fleet.loader import EngineLoader, Prepared
from jaxserve.fleet.memory import MemoryPlan, check_fits
from jaxserve.fleet.routing import Route, choose, shadows, sticky_unit
from jaxserve.fleet.versions import Counters, Lease, Version, VersionState

log = logging.getLogger("jaxserve.fleet")

_GONE = (VersionState.UNLOADED, VersionState.FAILED)


class Fleet:
    def __init__(self, loader=None, *, headroom_fraction: float = 0.05,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic,
                 eval_gate: Callable[[str, str], str | None] | None = None,
                 max_queued_requests: int | None = None):
        """`eval_gate(suite, version)`: why a version may not get more traffic on a route gated
        by that eval suite, or None (jaxserve.evals.gate, wired by the launcher).
        `max_queued_requests`: the server's shedding threshold (serve --max-queued-requests),
        which a route's degradation reads its queue signal against."""
        self.max_queued_requests = max_queued_requests
        self._loader = loader if loader is not None else EngineLoader()
        self._eval_gate = eval_gate
        # The budget the versions' kv_cache_memory_fraction split: what was free at the start.
        self.memory_budget_bytes = self._loader.free_bytes()
        self._headroom = int(headroom_fraction * self.memory_budget_bytes)
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # any state change, in_flight included
        self._versions: dict[str, Version] = {}
        self._routes: dict[str, Route] = {}  # replaced whole on every change, never mutated
        self._previous: dict[str, Route | None] = {}
        self._monitors: dict[str, CanaryMonitor] = {}
        self._breakers: dict[tuple[str, str], Breaker] = {}  # (route, version)
        self._counters: dict[tuple[str | None, str], Counters] = {}  # (route, version)
        self._trips: deque[Trip] = deque(maxlen=100)
        # Called with route=NAME when a route's settings change, version=NAME when a version
        # is unloaded: what answers there is no longer what was (the response cache listens).
        self._listeners: list[Callable[..., None]] = []
        self._loading = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-fleet-load")

    @classmethod
    def from_deployment(cls, path: Path, loader=None, **kwargs) -> "Fleet":
        """Load every version of a deployment file (blocking until all are ready) and install its
        routes. Any problem with the file is one ConfigError naming it and the field."""
        deployment = load_deployment(path)
        fleet = cls(loader, **kwargs)
        try:
            prepared = []
            for spec in deployment.versions:  # all checked before anything loads
                try:
                    prepared.append(fleet._loader.prepare(spec, fleet.memory_budget_bytes))
                except InvalidRequest as e:
                    field = f"version.{spec.name}" + (f".{e.param}" if e.param else "")
                    raise ConfigError(f"{path}: {field}: {e}") from None
                except (ModelNotFound, WeightsError, TokenizerError, ConfigError) as e:
                    raise ConfigError(f"{path}: version.{spec.name}.model: {e}") from None
            for spec, p in zip(deployment.versions, prepared):
                fleet._admit(spec, p)
            for spec in deployment.versions:
                version = fleet.wait(spec.name)
                if version.state is not VersionState.READY:
                    raise ConfigError(f"{path}: version.{spec.name}: loading failed: "
                                      f"{version.error}")
            for route in deployment.routes:
                try:
                    fleet.set_route(route)
                except InvalidRequest as e:
                    raise ConfigError(f"{path}: route.{route.name}.{e.param}: {e}") from None
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    @classmethod
    def of_engine(cls, name: str, engine: ServingEngine, *, manifest=None, pricing=None,
                  loader=None, eval_gate=None, max_queued_requests=None) -> "Fleet":
        """A fleet of one version whose engine was built outside it (`serve --model`, which may
        be replicas or a multi-host leader; a test's engine): addressed by `name`, no route.
        `loader`: what loads further versions (the admin API); by default none can be loaded."""
        fleet = cls(loader if loader is not None else _NoLoader(), eval_gate=eval_gate,
                    max_queued_requests=max_queued_requests)
        fleet.adopt(VersionSpec(name, name), engine, manifest, pricing)
        return fleet

    @classmethod
    def empty(cls) -> "Fleet":
        """A fleet with no version (a server that only embeds)."""
        return cls(_NoLoader())

    # ---- versions ----------------------------------------------------------------------------

    def adopt(self, spec: VersionSpec, engine: ServingEngine, manifest=None,
              pricing=None) -> Version:
        """Add a version whose engine is already loaded and warm: ready at once. Its memory was
        planned when it was built, so the fleet counts none for it."""
        with self._lock:
            if spec.name in self._versions or spec.name in self._routes:
                raise AlreadyExists(f"{spec.name!r} is already a version or a route",
                                    param="name")
            version = Version(spec, MemoryPlan(0, 0, 0), pricing, state=VersionState.READY,
                              engine=engine, manifest=manifest)
            self._versions[spec.name] = version
            self._changed.notify_all()
        return version

    def load(self, spec: VersionSpec) -> Version:
        """Admit a version and start loading it; returns at once (state `loading`)."""
        return self._admit(spec, self._loader.prepare(spec, self.memory_budget_bytes))

    def _admit(self, spec: VersionSpec, prepared: Prepared) -> Version:
        with self._lock:
            existing = self._versions.get(spec.name)
            if existing is not None and existing.state not in _GONE:
                raise AlreadyExists(f"version {spec.name!r} exists ({existing.state.value})",
                                    param="name")
            if spec.name in self._routes:
                raise InvalidRequest(f"{spec.name!r} is a route's name; a version needs its own",
                                     param="name")
            check_fits(spec.name, prepared.memory, self._loader.free_bytes(), self._reserved(),
                       self._headroom)
            version = self._versions[spec.name] = Version(spec, prepared.memory, prepared.pricing)
            for key in [k for k in self._counters if k[1] == spec.name]:
                del self._counters[key]  # a reused name starts its counts afresh
        self._loading.submit(self._load, version, prepared)
        log.info("version %s: loading %s", spec.name, spec.model)
        return version

    def _reserved(self) -> int:
        """Memory promised to versions still loading (planned, not yet allocated)."""
        return sum(v.memory.total_bytes for v in self._versions.values()
                   if v.state is VersionState.LOADING)

    def _load(self, version: Version, prepared: Prepared) -> None:
        try:
            loaded = self._loader.load(version.spec, prepared)
        except BaseException as e:  # noqa: BLE001 - the version says why; the fleet goes on
            log.exception("version %s: loading failed", version.name)
            with self._lock:
                version.state, version.error = VersionState.FAILED, f"{type(e).__name__}: {e}"
                self._changed.notify_all()
            return
        with self._lock:
            version.engine, version.manifest = loaded.engine, loaded.manifest
            version.load_seconds, version.compile_seconds = (loaded.load_seconds,
                                                             loaded.compile_seconds)
            version.state = VersionState.READY
            self._changed.notify_all()
        log.info("version %s: ready as %s (load %.1f s, compile %.1f s)", version.name,
                 loaded.manifest.id, loaded.load_seconds, loaded.compile_seconds)

    def wait(self, name: str, timeout: float | None = None) -> Version:
        """Block until the version is neither loading nor draining (or the timeout passes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            version = self._version(name)
            while version.state in (VersionState.LOADING, VersionState.DRAINING):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return version

    def unload(self, name: str) -> Version:
        """Drain, then free the version (returns at once, state `draining`). Refused (Conflict)
        while a route gives it weight or shadow traffic, or while it loads."""
        with self._lock:
            version = self._version(name)
            if version.state is VersionState.LOADING or version.changing:
                raise Conflict(f"version {name!r} is loading, falling asleep or waking; unload "
                               f"it once it is ready", param="name")
            if version.state in (VersionState.DRAINING, VersionState.UNLOADED):
                return version
            users = sorted(r.name for r in self._routes.values() if r.names(name))
            if users:
                raise Conflict(f"version {name!r} still gets traffic from route(s) "
                               f"{', '.join(users)}; set its weight and shadow there to 0 first",
                               param="name")
            if version.state is VersionState.FAILED:
                version.state = VersionState.UNLOADED
                self._changed.notify_all()
                return version
            version.state = VersionState.DRAINING
            self._changed.notify_all()
        threading.Thread(target=self._drain, args=(version,), daemon=True,
                         name=f"jaxserve-fleet-drain-{name}").start()
        log.info("version %s: draining (%d in flight)", name, version.in_flight)
        return version

    def _drain(self, version: Version) -> None:
        with self._changed:
            while version.in_flight:
                self._changed.wait()
            engine, version.engine = version.engine, None  # None: shutdown() took it
        if engine is not None:
            try:
                self._loader.unload(engine)
            except Exception:  # noqa: BLE001 - it is out of service either way
                log.exception("version %s: unloading raised", version.name)
        with self._lock:
            version.state = VersionState.UNLOADED
            self._changed.notify_all()
            self._tell(version=version.name)
        log.info("version %s: unloaded", version.name)

    # ---- sleep (POST /sleep, /wake_up): a warm standby -----------------------------------------

    def sleep(self, name: str, level: int, timeout: float = 30.0) -> Version:
        """Put a version to sleep (vLLM's POST /sleep): level 1 frees its KV cache, level 2 also
        moves its weights to host memory; its compiled programs stay, so waking compiles
        nothing. From this call on its new requests get 503; those in flight finish first (past
        `timeout` seconds the version is as it was and the call a Conflict). Refused while a
        route gives it traffic. Blocks: call off the event loop."""
        if level not in (1, 2):
            raise InvalidRequest(f"level must be 1 or 2, got {level!r}", param="level")
        with self._changed:
            version = self._changing(name, "sleep")
            users = sorted(r.name for r in self._routes.values() if r.names(name))
            if users:
                raise Conflict(f"version {name!r} still gets traffic from route(s) "
                               f"{', '.join(users)}; set its weight and shadow there to 0 first",
                               param="name")
            before, version.state, version.changing = version.state, VersionState.SLEEPING, True
            deadline = time.monotonic() + timeout
            while version.in_flight and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            if version.in_flight:
                version.state, version.changing = before, False
                self._changed.notify_all()
                raise Conflict(f"version {name!r} still has {version.in_flight} requests in "
                               f"flight after {timeout:g} s", param="timeout")
        def sleep() -> None:
            # The leases are back; the engine may still hand out the last outputs or finish a
            # launched step (new requests are refused), so a Conflict is retried until then.
            while True:
                try:
                    return version.engine.sleep(level)
                except Conflict:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
        self._settle(version, sleep)
        log.info("version %s: asleep (level %d: %s)", name, level, ", ".join(version.sleeping))
        return version

    def wake_up(self, name: str, tags: Sequence[str] | None = None) -> Version:
        """Bring back what `tags` name ("weights", "kv_cache"; None: all) once the memory for
        it is free; the version is ready again once nothing sleeps. Blocks."""
        with self._changed:
            version = self._changing(name, "wake")
            if version.state is VersionState.READY:
                return version
            asleep = set(version.sleeping) & set(tags if tags is not None else version.sleeping)
            needed = MemoryPlan(version.memory.weights_bytes if "weights" in asleep else 0,
                                version.memory.kv_cache_bytes if "kv_cache" in asleep else 0, 0)
            check_fits(name, needed, self._loader.free_bytes(), self._reserved(), self._headroom)
            version.changing = True
        self._settle(version, lambda: version.engine.wake_up(tags))
        log.info("version %s: %s", name, version.state.value)
        return version

    def _changing(self, name: str, what: str) -> Version:
        version = self._version(name)
        if version.changing:
            raise Conflict(f"version {name!r}: a sleep or wake is under way", param="name")
        if version.state not in (VersionState.READY, VersionState.SLEEPING):
            raise Conflict(f"version {name!r} is {version.state.value}; only a ready or "
                           f"sleeping version can {what}", param="name")
        return version

    def _settle(self, version: Version, change: Callable[[], None]) -> None:
        """Run a sleep or wake on the engine, then set the state from what sleeps there."""
        try:
            change()
        finally:
            with self._lock:
                version.sleeping = tuple(sorted(version.engine.sleeping_tags))
                version.state = VersionState.SLEEPING if version.sleeping else VersionState.READY
                version.changing = False
                self._changed.notify_all()

    def _version(self, name: str) -> Version:
        version = self._versions.get(name)
        if version is None:
            raise NotFound(f"no version {name!r}", param="name")
        return version

    # ---- routes ------------------------------------------------------------------------------

    def _check_route(self, route: Route) -> None:
        if route.name in self._versions and self._versions[route.name].state not in _GONE:
            raise InvalidRequest(f"{route.name!r} is a version's name; a route needs its own",
                                 param="route")
        for kind, shares in (("weights", route.weights), ("shadow", route.shadow)):
            for name, share in shares:
                version = self._versions.get(name)
                if version is None:
                    raise InvalidRequest(f"'{kind}.{name}' names no version",
                                         param=f"{kind}.{name}")
                if share > 0 and version.state is not VersionState.READY:
                    raise Conflict(f"version {name!r} is {version.state.value}; only a ready "
                                   f"version can take traffic", param=f"{kind}.{name}")
        if route.degrade is not None:
            self._check_degrade(route)

    def _check_degrade(self, route: Route) -> None:
        degrade = route.degrade
        if degrade.degrade_to is not None:
            version = self._versions.get(degrade.degrade_to)
            if version is None:
                raise InvalidRequest("'degrade.degrade_to' names no version",
                                     param="degrade.degrade_to")
            if version.state is not VersionState.READY:
                raise Conflict(f"version {degrade.degrade_to!r} is {version.state.value}; only "
                               f"a ready version can take traffic", param="degrade.degrade_to")
        if degrade.kv_usage is None and self.max_queued_requests is None:
            raise InvalidRequest("'degrade' has no overload signal: its queue_fraction is of the "
                                 "shedding threshold, and this server has none (serve "
                                 "--max-queued-requests N); or set degrade.kv_usage",
                                 param="degrade")

    def _swap(self, route: Route, previous: Route | None) -> None:
        self._routes = {**self._routes, route.name: route}
        self._previous[route.name] = previous
        self._changed.notify_all()
        self._tell(route=route.name)

    def on_change(self, listener: Callable[..., None]) -> None:
        """`listener(route=NAME)` after a route's settings change (set, rolled back, a canary
        trip), `listener(version=NAME)` once a version is unloaded; called under the fleet's
        lock, so it must not call the fleet."""
        self._listeners.append(listener)

    def _tell(self, **change: str) -> None:
        for listener in self._listeners:
            listener(**change)

    def _check_eval_gate(self, route: Route) -> None:
        """A gated route's weight on a version grows only once that version passed the suite
        (its stored results: the gate reads them, it never runs an eval inside this call)."""
        current = self._routes.get(route.name)
        if route.eval_gate is None or current is None:  # a new route is installed as given
            return
        for name, weight in route.weights:
            if weight > current.weight(name):
                refusal = (self._eval_gate(route.eval_gate, name) if self._eval_gate is not None
                           else "this server has no eval gate")
                if refusal is not None:
                    raise Conflict(f"route {route.name!r}: the weight of {name!r} may not grow: "
                                   f"{refusal}", param=f"weights.{name}")

    def set_route(self, route: Route) -> Route:
        """Create or replace a route (all at once)."""
        self._check_eval_gate(route)
        with self._lock:
            self._check_route(route)
            self._swap(route, self._routes.get(route.name))
        log.info("route %s: %s", route.name, route.to_dict())
        return route

    def route(self, name: str) -> Route | None:
        return self._routes.get(name)

    def rollback(self, name: str) -> Route:
        """Restore the route's previous settings (and keep the current ones as the previous)."""
        with self._lock:
            current = self._routes.get(name)
            if current is None:
                raise NotFound(f"no route {name!r}", param="route")
            previous = self._previous.get(name)
            if previous is None:
                raise Conflict(f"route {name!r} has no previous settings to roll back to",
                               param="route")
            self._check_route(previous)
            self._swap(previous, current)
        log.info("route %s: rolled back to %s", name, previous.to_dict())
        return previous

    # ---- requests ----------------------------------------------------------------------------

    def select(self, model: str, *, user: str | None = None, api_key: str | None = None,
               priority: int | None = None) -> Lease:
        """The lease for one request to `model` (a route or a version name). `priority`: the
        request's class (ServiceClass), which the route's degradation reads; None: never
        degraded."""
        with self._lock:
            route = self._routes.get(model)
            if route is None:
                return self._lease(None, self._addressed(model), shadow=False)
            key = {"user": user, "api_key": api_key}.get(route.sticky)
            unit = sticky_unit(route.name, key) if key is not None else self._rng.random()
            ready = eligible = self._is_ready
            if route.breaker is not None:  # open breakers and stalled engines get no traffic
                now = self._clock()

                def eligible(v: str) -> bool:
                    return ready(v) and not self._stalled(v) and \
                        self._breaker(route, v).admits(now)
            primary = choose(route, unit, eligible)
            if primary is None:
                raise EngineOverloaded(f"route {model!r} has no ready version")
            degradation = None
            if route.degrade is not None and priority is not None \
                    and route.degrade.applies(priority):
                primary, degradation = self._degrade(route, primary, eligible)
            copies = shadows(route, primary, [self._rng.random() for _ in route.shadow], ready)
            lease = self._lease(route.name, self._versions[primary], shadow=False)
            lease.degradation = degradation
            if route.breaker is not None:
                lease.probe = self._breaker(route, primary).take()
            lease.shadows = tuple(self._lease(route.name, self._versions[v], shadow=True)
                                  for v in copies)
            return lease

    def _degrade(self, route: Route, primary: str, eligible: Callable[[str], bool]
                 ) -> tuple[str, Degradation | None]:
        """(the version that answers, what degradation it gets) for a request of a class the
        route may degrade, from the load of the version chosen for it."""
        degrade = route.degrade
        signal = overload(degrade, self._versions[primary].engine, self.max_queued_requests)
        if signal is None:
            return primary, None
        target = degrade.degrade_to
        if target is None or target == primary or not eligible(target):
            # Nowhere to move it (its breaker open, asleep, unloaded): capped, if the route caps.
            return primary, (Degradation(signal, degrade.max_tokens)
                             if degrade.max_tokens is not None else None)
        return target, Degradation(signal, degrade.max_tokens, moved_from=primary)

    def _stalled(self, name: str) -> bool:
        engine = self._versions[name].engine
        return engine is not None and bool(getattr(engine, "is_stalled", False))

    def _breaker(self, route: Route, version: str) -> Breaker:
        """The route's breaker of `version` (a fresh one when the route's settings changed)."""
        breaker = self._breakers.get((route.name, version))
        if breaker is None or breaker.config != route.breaker:
            breaker = self._breakers[(route.name, version)] = Breaker(route.breaker)
        return breaker

    def _is_ready(self, name: str) -> bool:
        version = self._versions.get(name)
        return version is not None and version.state is VersionState.READY

    def _addressed(self, name: str) -> Version:
        version = self._versions.get(name)
        if version is None or version.state in _GONE:
            # OpenAI's wording. It names no model that does exist: the caller may be a tenant
            # that may not use it (GET /v1/models lists the ones it may).
            raise ModelNotFound(f"The model '{name}' does not exist (GET /v1/models lists the "
                                f"models you may use)")
        if version.state is VersionState.LOADING:
            raise EngineOverloaded(f"version {name!r} is still loading")
        if version.state is VersionState.DRAINING:
            raise ModelNotFound(f"version {name!r} is being unloaded")
        if version.state is VersionState.SLEEPING:
            raise EngineOverloaded(f"version {name!r} is asleep; an operator wakes it "
                                   f"(POST /wake_up)")
        return version

    def _lease(self, route: str | None, version: Version, shadow: bool) -> Lease:
        version.in_flight += 1
        return Lease(self, route, version, shadow)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease.done:
                raise RuntimeError("a lease ends exactly once")
            lease.done = True
            lease.version.in_flight -= 1
            if lease.probe:  # a probe that never ran: the next request may probe
                self._breakers[(lease.route, lease.version.name)].released(True)
            self._changed.notify_all()

    def _finish(self, lease: Lease, *, error: bool, ttft: float | None, prompt_tokens: int,
                completion_tokens: int, token_agreement: float | None,
                availability: str = "good", cached_tokens: int = 0) -> None:
        version = lease.version
        cost = (version.pricing.cost(prompt_tokens, completion_tokens, cached_tokens)
                if version.pricing is not None else None)
        with self._lock:
            probe = lease.probe
            self._release(lease)
            c = self._counters.setdefault((lease.route, version.name), Counters())
            if lease.shadow:
                c.shadow_requests += 1
                c.shadow_errors += error
                if token_agreement is not None:
                    c.shadow_compared += 1
                    c.shadow_token_agreement_sum += token_agreement
                return
            c.requests += 1
            c.errors += error
            c.prompt_tokens += prompt_tokens
            c.completion_tokens += completion_tokens
            c.cost_usd += cost or 0.0
            if lease.route is None:
                return
            route, now = self._routes[lease.route], self._clock()
            if route.breaker is not None:
                self._breaker(route, version.name).record(now, error, probe)
            if lease.degradation is not None:  # not what the route's versions normally serve
                return
            monitor = self._monitors.setdefault(lease.route, CanaryMonitor())
            monitor.record(version.name, Sample(now, error, ttft,
                                                prompt_tokens + completion_tokens, cost,
                                                availability))
            for trip in monitor.evaluate(route, now):
                self._trip(trip, monitor)

    def _trip(self, trip: Trip, monitor: CanaryMonitor) -> None:
        route = self._routes[trip.route]
        self._swap(route.with_weight(trip.version, 0.0), route)
        monitor.forget(trip.version)
        self._counters.setdefault((trip.route, trip.version), Counters()).canary_trips += 1
        self._trips.append(trip)
        log.warning(trip.message())

    # ---- views -------------------------------------------------------------------------------

    def engines(self) -> dict[str, ServingEngine]:
        """The engines of the versions that serve (ready or draining), by version name."""
        with self._lock:
            return {n: v.engine for n, v in sorted(self._versions.items())
                    if v.engine is not None and v.state in (VersionState.READY,
                                                            VersionState.DRAINING)}

    def metered_engines(self) -> dict[str, ServingEngine]:
        """The engines whose numbers /metrics reads, by version name: those that serve and
        those asleep, whose series keep their values (nothing running, their token counts)
        instead of vanishing while they sleep."""
        with self._lock:
            return {n: v.engine for n, v in sorted(self._versions.items())
                    if v.engine is not None and v.state in (
                        VersionState.READY, VersionState.DRAINING, VersionState.SLEEPING)}

    def health(self) -> str:
        """"ready" while any serving version can answer (others may be loading or draining),
        else "asleep" (every version that could answer sleeps: POST /wake_up), "engine stopped"
        (every engine loop died: a balancer should move on) or "engine stalled" (no step for the
        stall timeout while work waits). /ready and gRPC health."""
        running = [e for e in self.engines().values() if e.is_running]
        if not running:
            return "asleep" if any(v.state is VersionState.SLEEPING
                                   for v in self._versions.values()) else "engine stopped"
        return "engine stalled" if all(e.is_stalled for e in running) else "ready"

    def counters(self) -> dict[tuple[str, str], Counters]:
        """A snapshot of the counters by (route, version); route "" for a version addressed by
        name."""
        with self._lock:
            return {(r or "", v): dataclasses.replace(c) for (r, v), c in self._counters.items()}

    def models(self) -> tuple[list[str], list[Version]]:
        """What a client may address: the routes' names and the ready versions."""
        with self._lock:
            return sorted(self._routes), [self._versions[n] for n in self.ready_versions()]

    def ready_versions(self) -> list[str]:
        return sorted(n for n, v in self._versions.items() if v.state is VersionState.READY)

    def version_info(self, name: str) -> dict:
        with self._lock:
            version = self._version(name)
            totals = Counters()
            for (_, v), c in self._counters.items():
                if v == name:
                    totals = totals.add(c)
            return {**version.to_dict(), "counters": totals.to_dict()}

    def versions_info(self) -> list[dict]:
        with self._lock:
            return [self.version_info(n) for n in sorted(self._versions)]

    def route_info(self, name: str) -> dict:
        with self._lock:
            route = self._routes.get(name)
            if route is None:
                raise NotFound(f"no route {name!r}", param="route")
            monitor, now = self._monitors.get(name), self._clock()
            window = route.canary.window_seconds if route.canary is not None else 300.0
            names = sorted({v for v, _ in route.weights + route.shadow})
            versions = {}
            for v in names:
                version = self._versions.get(v)
                versions[v] = {
                    "state": version.state.value if version is not None else None,
                    "weight": route.weight(v), "shadow": dict(route.shadow).get(v, 0.0),
                    "counters": self._counters.get((name, v), Counters()).to_dict(),
                    "window": monitor.stats(v, now, window).to_dict() if monitor else None,
                    "breaker": (self._breaker(route, v).to_dict() if route.breaker is not None
                                else None)}
            return {**route.to_dict(), "has_previous": self._previous.get(name) is not None,
                    "versions": versions,
                    "canary_trips": [dataclasses.asdict(t) for t in self._trips
                                     if t.route == name]}

    def routes_info(self) -> list[dict]:
        with self._lock:
            return [self.route_info(n) for n in sorted(self._routes)]

    def shutdown(self) -> None:
        """Stop loading and shut every engine down (in-flight requests end with EngineDead)."""
        self._loading.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            engines = [v.engine for v in self._versions.values() if v.engine is not None]
            for version in self._versions.values():
                version.engine = None
                version.state = VersionState.UNLOADED
            self._changed.notify_all()
        for engine in engines:
            self._loader.unload(engine)


class _NoLoader:
    """The loader of a fleet made around one prebuilt engine: it loads nothing more."""

    def free_bytes(self) -> int:
        return 0

    def prepare(self, spec: VersionSpec, budget_bytes: int):
        raise ConfigError("this server serves one model (--model); start it with --deployment "
                          "to load versions at run time")

    def unload(self, engine: ServingEngine) -> None:
        engine.shutdown()

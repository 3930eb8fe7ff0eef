"""The fleet's host side with fake engines: the deployment file, routing (weights, stickiness,
shadows), atomic route changes and rollback, drain-then-unload, memory admission and the canary
gate. The real engine's load path is tested in test_admin_routes.py."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxserve.errors import (AlreadyExists, ConfigError, Conflict, EngineOverloaded,
                             InsufficientMemory, InvalidRequest, ModelNotFound)
from jaxserve.fleet.deployment import VersionSpec, load_deployment, parse_route
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.loader import Loaded, Prepared
from jaxserve.fleet.manifest import Manifest
from jaxserve.fleet.memory import MemoryPlan
from jaxserve.fleet.routing import Route, choose, sticky_unit
from jaxserve.fleet.versions import VersionState
from jaxserve.gateway.pricing import Pricing

ISSUE_EXAMPLE = """
[version.smol-v1]
model = "smollm2-135m-instruct"     # registry name or path, as --model takes
kv_cache_memory_fraction = 0.4      # engine flags per version
[version.smol-v2]
model = "/models/smol-v2-orbax"
max_model_len = 1024                # any engine flag; those that change outputs enter the manifest
[route.smollm2]                     # the name clients send as "model"
weights = { smol-v1 = 90, smol-v2 = 10 }
sticky = "user"                     # "user" (OpenAI `user` field), "api_key", or "none"
shadow = { smol-v2 = 0.2 }          # also send 20% of requests to smol-v2; answers discarded
"""


class FakeEngine:
    def __init__(self):
        self.stopped = False

    def shutdown(self):
        self.stopped = True


class FakeLoader:
    """Versions cost 100 bytes of weights + 10 per page (`num_pages`, default 10) out of
    `total` bytes; `gate` (an Event) holds loads until set."""

    def __init__(self, total: int = 10_000, gate: threading.Event | None = None):
        self.total, self.gate, self.allocated = total, gate, {}

    def free_bytes(self) -> int:
        return self.total - sum(self.allocated.values())

    def prepare(self, spec: VersionSpec, budget: int) -> Prepared:
        if spec.model == "missing":
            raise ModelNotFound("unknown model 'missing'")
        pages = dict(spec.engine_args).get("num_pages", 10)
        return Prepared(MemoryPlan(100, 10 * pages, pages), spec.pricing)

    def load(self, spec: VersionSpec, prepared: Prepared) -> Loaded:
        if self.gate is not None:
            self.gate.wait(10)
        if spec.model == "broken":
            raise RuntimeError("corrupted weights")
        engine = FakeEngine()
        self.allocated[id(engine)] = prepared.memory.total_bytes
        return Loaded(engine, Manifest(f"fp_{spec.name}", {}), 0.5, 1.5)

    def unload(self, engine: FakeEngine) -> None:
        engine.shutdown()
        del self.allocated[id(engine)]


def spec(name: str, **kw) -> VersionSpec:
    model = kw.pop("model", "m")
    pricing = kw.pop("pricing", None)
    return VersionSpec(name, model, engine_args=tuple(sorted(kw.items())), pricing=pricing)


def ready_fleet(*names: str, loader: FakeLoader | None = None, **kw) -> Fleet:
    fleet = Fleet(loader or FakeLoader(), rng=random.Random(0), **kw)
    for n in names:
        fleet.load(spec(n))
        assert fleet.wait(n, 10).state is VersionState.READY
    return fleet


def route(name="r", weights=None, **kw) -> Route:
    return parse_route(name, {"weights": weights or {"a": 90, "b": 10}, **kw})


# ---------------------------------------------------------------- the deployment file


def test_the_issues_example_parses(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text(ISSUE_EXAMPLE)
    d = load_deployment(path)
    assert [v.name for v in d.versions] == ["smol-v1", "smol-v2"]
    assert dict(d.versions[0].engine_args) == {"kv_cache_memory_fraction": 0.4}
    assert dict(d.versions[1].engine_args) == {"max_model_len": 1024}
    (r,) = d.routes
    assert (r.name, dict(r.weights), r.sticky, dict(r.shadow)) == (
        "smollm2", {"smol-v1": 90.0, "smol-v2": 10.0}, "user", {"smol-v2": 0.2})


A = '[version.a]\nmodel = "m"\n'


@pytest.mark.parametrize("text, field", [
    (A + 'max_model_len = "long"', "version.a.max_model_len"),
    (A + 'max_modle_len = 5', "version.a.max_modle_len"),
    (A + 'enable_prefix_caching = 1', "version.a.enable_prefix_caching"),
    ('[version.a]\nkv_cache_memory_fraction = 0.4', "version.a.model"),
    (A + 'dtype = "int8"', "version.a.dtype"),
    (A + 'generation = { temprature = 0.5 }', "version.a.generation.temprature"),
    (A + 'pricing = { prompt_per_1m = -1 }', "version.a.pricing.prompt_per_1m"),
    ('[version."a/b"]\nmodel = "m"', "version.a/b"),
    (A + '[route.r]\nweights = { a = 1 }\nsticky = "cookie"', "route.r.sticky"),
    (A + '[route.r]\nweights = { b = 1 }', "route.r.weights.b"),
    (A + '[route.r]\nweights = { a = 0 }', "route.r.weights"),
    (A + '[route.r]\nweights = { a = -5 }', "route.r.weights.a"),
    (A + '[route.r]\nweights = { a = 1 }\nshadow = { a = 1.5 }', "route.r.shadow.a"),
    (A + '[route.a]\nweights = { a = 1 }', "route.a"),
    ('[version.a]\nmodel = "m"\n[route.r]\nweights = { a = 1 }\ncanary = { incumbent = "z" }',
     "route.r.canary.incumbent"),
    ('[version.a]\nmodel = "m"\n[route.r]\nweights = { a = 1 }\ncanary = { max_cost_ratio = 0.5 }',
     "route.r.canary.max_cost_ratio"),
    ('[versions.a]\nmodel = "m"', "versions"),
    ('[route.r]\nweights = { a = 1 }', "version"),
])
def test_a_malformed_file_is_one_config_error_naming_file_and_field(tmp_path, text, field):
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_deployment(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and field in message.split()[1], message


def test_unreadable_or_invalid_toml_names_the_file(tmp_path):
    path = tmp_path / "deploy.toml"
    with pytest.raises(ConfigError, match="cannot read the deployment file"):
        load_deployment(path)
    path.write_text("[version.a\n")
    with pytest.raises(ConfigError, match=f"{path}: not valid TOML"):
        load_deployment(path)


def test_host_side_modules_import_no_jax():
    code = ("import sys; import jaxserve.fleet.deployment, jaxserve.fleet.routing, "
            "jaxserve.fleet.canary, jaxserve.fleet.versions; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[1])


# ---------------------------------------------------------------- routing


def test_weighted_split_and_stickiness_over_200_users():
    r = route(weights={"a": 90, "b": 10}, sticky="user")
    picks = [choose(r, sticky_unit("r", f"user-{i}"), lambda v: True) for i in range(200)]
    # Binomial(200, 0.1): mean 20, sd 4.2; 4 sd either side.
    assert 3 <= picks.count("b") <= 37
    # one user, one version, however often asked and whatever order the weights are written in
    reordered = parse_route("r", {"weights": {"b": 10, "a": 90}, "sticky": "user"})
    assert all(choose(reordered, sticky_unit("r", f"user-{i}"), lambda v: True) == p
               for i, p in enumerate(picks))
    # a version that is not eligible gets nothing; its share goes to the others
    assert {choose(r, u / 100, lambda v: v == "b") for u in range(100)} == {"b"}
    assert choose(r, 0.5, lambda v: False) is None


def test_fleet_split_sticky_user_api_key_and_shadows():
    fleet = ready_fleet("a", "b")
    fleet.set_route(route(weights={"a": 75, "b": 25}, sticky="user", shadow={"b": 0.5}))
    chosen = {}
    for i in range(200):
        with fleet.select("r", user=f"u{i}") as lease:
            chosen[i] = lease.version.name
            assert all(s.shadow and s.version.name == "b" for s in lease.shadows)
            assert lease.version.name != "b" or not lease.shadows  # never shadow itself
    assert 50 - 25 <= list(chosen.values()).count("b") <= 50 + 25
    assert all(fleet.select("r", user=f"u{i}").version.name == v for i, v in chosen.items()
               if i < 20)
    # api_key stickiness reads the key, not the user
    fleet.set_route(route(weights={"a": 50, "b": 50}, sticky="api_key"))
    key_picks = {fleet.select("r", user=f"u{i}", api_key="k1").version.name for i in range(30)}
    assert len(key_picks) == 1
    # shadow share: about half of the requests that went to "a" were also copied to "b"
    fleet.set_route(route(weights={"a": 1}, shadow={"b": 0.5}))
    copies = sum(len(fleet.select("r").shadows) for _ in range(400))
    assert 200 - 60 <= copies <= 200 + 60


def test_direct_addressing_and_unknown_models():
    fleet = ready_fleet("a")
    assert fleet.select("a").version.name == "a" and fleet.select("a").route is None
    with pytest.raises(ModelNotFound, match="The model 'nope' does not exist"):
        fleet.select("nope")


# ---------------------------------------------------------------- route changes


def test_route_updates_are_atomic_under_concurrent_selection():
    """Selectors on 4 threads while the route flips between two settings: every request gets a
    ready version of one whole setting (never none, never a mix), and none fails."""
    fleet = ready_fleet("a", "b", "c")
    one, other = route(weights={"a": 1}, shadow={"c": 1.0}), route(weights={"b": 1})
    fleet.set_route(one)
    errors, seen, stop, count = [], set(), threading.Event(), [0]

    def select():
        try:
            while not stop.is_set():
                with fleet.select("r") as lease:
                    seen.add((lease.version.name, tuple(s.version.name for s in lease.shadows)))
                    assert lease.version.state is VersionState.READY
                count[0] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=select) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(40):
        fleet.set_route(other if i % 2 == 0 else one)
        done = count[0]
        while count[0] == done and not errors:  # let some requests see this setting
            time.sleep(0)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors
    assert seen == {("a", ("c",)), ("b", ())}


def test_rollback_swaps_with_the_previous_settings():
    fleet = ready_fleet("a", "b")
    with pytest.raises(Exception, match="no route 'r'"):
        fleet.rollback("r")
    first = fleet.set_route(route(weights={"a": 1}))
    with pytest.raises(Conflict, match="no previous settings"):
        fleet.rollback("r")
    second = fleet.set_route(parse_route("r", {"weights": {"b": 1}}, base=first))
    assert fleet.rollback("r") == first and fleet.route("r") == first
    assert fleet.rollback("r") == second  # rolling back a rollback re-applies it


def test_route_checks_against_the_fleet():
    gate = threading.Event()
    gate.set()
    fleet = ready_fleet("a", loader=FakeLoader(gate=gate))
    with pytest.raises(InvalidRequest, match="'weights.z' names no version"):
        fleet.set_route(route(weights={"a": 1, "z": 0}))
    with pytest.raises(InvalidRequest, match="is a version's name"):
        fleet.set_route(route(name="a", weights={"a": 1}))
    gate.clear()
    fleet.load(spec("slow"))
    with pytest.raises(Conflict, match="'slow' is loading"):
        fleet.set_route(route(weights={"a": 1, "slow": 1}))
    fleet.set_route(route(weights={"a": 1, "slow": 0}))  # named at weight 0: fine
    with pytest.raises(AlreadyExists):
        fleet.load(spec("slow"))
    with pytest.raises(InvalidRequest, match="is a route's name"):
        fleet.load(spec("r"))
    gate.set()
    assert fleet.wait("slow", 10).state is VersionState.READY


# ---------------------------------------------------------------- load, memory, unload


def test_loading_then_ready_or_failed():
    gate = threading.Event()
    fleet = Fleet(FakeLoader(gate=gate))
    v = fleet.load(spec("a"))
    assert v.state is VersionState.LOADING and v.fingerprint is None
    with pytest.raises(EngineOverloaded, match="still loading"):
        fleet.select("a")
    gate.set()
    assert fleet.wait("a", 10).state is VersionState.READY
    info = fleet.version_info("a")
    assert (info["system_fingerprint"], info["load_seconds"], info["compile_seconds"]) == (
        "fp_a", 0.5, 1.5)
    bad = fleet.load(spec("bad", model="broken"))
    assert fleet.wait("bad", 10).state is VersionState.FAILED
    assert "corrupted weights" in bad.error
    with pytest.raises(ModelNotFound):
        fleet.load(spec("x", model="missing"))


def test_a_version_that_does_not_fit_is_refused_before_allocating():
    gate = threading.Event()
    loader = FakeLoader(total=2_000, gate=gate)
    fleet = Fleet(loader, headroom_fraction=0.1)  # 200 bytes kept free
    fleet.load(spec("a", num_pages=50))  # 600 bytes, promised while it loads
    fleet.load(spec("b", num_pages=50))
    # 2000 free - 1200 promised - 200 headroom = 600 left: 610 does not fit
    with pytest.raises(InsufficientMemory, match=r"version c does not fit: it needs 0 MiB"):
        fleet.load(spec("c", num_pages=51))
    assert "c" not in [v["name"] for v in fleet.versions_info()]
    fleet.load(spec("c", num_pages=50))
    gate.set()
    for n in "abc":
        fleet.wait(n, 10)
    assert loader.free_bytes() == 200


def test_a_data_parallel_version_splits_its_share_between_its_replicas():
    """data_parallel_size n: n copies of the weights and n pools that share the version's
    kv_cache_memory_fraction of the budget, all counted against it; num_pages is a replica's."""
    from jaxserve.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig)
    from jaxserve.fleet.memory import plan_memory

    model = ModelConfig(name="m", vocab_size=64, hidden_size=64, intermediate_size=96,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    page = 2 * 2 * 2 * 16 * 16 * 4  # layers x K,V x KV heads x head_dim x page_size x f32

    def plan(dp: int, **cache) -> MemoryPlan:
        return plan_memory(EngineConfig(model, CacheConfig(**cache), SchedulerConfig(),
                                        ParallelConfig(data_parallel_size=dp)), 1 << 20)

    one, two = plan(1), plan(2)
    assert (one.num_pages, one.replicas) == (64, 1)  # half of 1 MiB in 8 KiB pages
    assert (two.num_pages, two.replicas) == (32, 2)
    assert two.weights_bytes == 2 * one.weights_bytes
    assert two.kv_cache_bytes == one.kv_cache_bytes == 64 * page
    fixed = plan(2, num_pages=10)
    assert (fixed.num_pages, fixed.kv_cache_bytes) == (10, 2 * 10 * page)
    assert fixed.to_dict()["replicas"] == 2


def test_unload_is_refused_while_routed_then_drains_and_frees():
    loader = FakeLoader()
    fleet = ready_fleet("a", "b", loader=loader)
    fleet.set_route(route(weights={"a": 9, "b": 1}, shadow={"b": 0.0}))
    with pytest.raises(Conflict, match="still gets traffic from route\\(s\\) r"):
        fleet.unload("b")
    lease = fleet.select("b")  # in flight on b
    fleet.set_route(route(weights={"a": 1, "b": 0}))
    engine = fleet._versions["b"].engine
    assert fleet.unload("b").state is VersionState.DRAINING
    with pytest.raises(ModelNotFound, match="being unloaded"):
        fleet.select("b")
    assert fleet.wait("b", 0.2).state is VersionState.DRAINING and not engine.stopped
    lease.finish(prompt_tokens=3, completion_tokens=4)  # the last request ends
    assert fleet.wait("b", 10).state is VersionState.UNLOADED
    assert engine.stopped and loader.free_bytes() == loader.total - 200
    assert fleet.version_info("b")["counters"]["completion_tokens"] == 4
    with pytest.raises(Conflict, match="'b' is unloaded"):
        fleet.set_route(route(weights={"a": 1, "b": 1}))
    fleet.load(spec("b"))  # the name can be loaded again, counts start afresh
    assert fleet.wait("b", 10).state is VersionState.READY
    assert fleet.version_info("b")["counters"]["requests"] == 0


def test_a_lease_ends_exactly_once():
    fleet = ready_fleet("a")
    lease = fleet.select("a")
    lease.finish()
    with pytest.raises(RuntimeError, match="exactly once"):
        lease.finish()
    with fleet.select("a"):
        pass
    assert fleet._versions["a"].in_flight == 0


def test_from_deployment_loads_versions_and_routes(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text('[version.a]\nmodel = "m"\n[version.b]\nmodel = "m"\n'
                    '[route.r]\nweights = { a = 3, b = 1 }\nsticky = "api_key"\n')
    fleet = Fleet.from_deployment(path, FakeLoader())
    assert fleet.ready_versions() == ["a", "b"] and fleet.route("r").sticky == "api_key"
    path.write_text('[version.a]\nmodel = "broken"\n')
    with pytest.raises(ConfigError, match="version.a: loading failed: RuntimeError: corrupted"):
        Fleet.from_deployment(path, FakeLoader())


# ---------------------------------------------------------------- the canary gate


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _traffic(fleet: Fleet, clock: Clock, version: str, n: int, **outcome) -> None:
    for _ in range(n):
        clock.now += 0.1
        fleet._finish(fleet._lease("r", fleet._versions[version], shadow=False), **{
            "error": False, "ttft": 0.1, "prompt_tokens": 10, "completion_tokens": 10,
            "token_agreement": None, **outcome})


@pytest.mark.parametrize("outcome, reason", [
    ({"ttft": 0.5}, "ttft_p99"),
    ({"error": True}, "error_rate"),
    ({}, "cost_per_1k_tokens"),  # as fast and healthy, but priced 2x
])
def test_canary_gate_zeroes_a_breaching_version(outcome, reason, caplog):
    clock = Clock()
    loader = FakeLoader()
    fleet = Fleet(loader, rng=random.Random(0), clock=clock)
    fleet.load(spec("a", pricing=Pricing(1.0, 1.0)))
    fleet.load(spec("b", pricing=Pricing(2.0, 2.0) if not outcome else Pricing(1.0, 1.0)))
    fleet.wait("a", 10), fleet.wait("b", 10)
    fleet.set_route(route(weights={"a": 95, "b": 5},
                          canary={"min_requests": 20, "window_seconds": 60}))
    assert fleet.route("r").canary.incumbent == "a"  # the heaviest weight by default
    _traffic(fleet, clock, "a", 30)
    _traffic(fleet, clock, "b", 19, **outcome)
    assert fleet.route("r").weight("b") == 5  # too few requests to judge
    _traffic(fleet, clock, "b", 1, **outcome)
    assert fleet.route("r").weight("b") == 0
    info = fleet.route_info("r")
    assert info["versions"]["b"]["counters"]["canary_trips"] == 1
    assert [t["reason"] for t in info["canary_trips"]] == [reason]
    assert f"'b' {reason}" in caplog.text and "its weight is now 0" in caplog.text
    # the trip is a route change: rollback restores the canary's share, with a fresh window
    assert fleet.rollback("r").weight("b") == 5
    _traffic(fleet, clock, "b", 5, **outcome)
    assert fleet.route("r").weight("b") == 5


def test_canary_gate_passes_a_healthy_version_and_forgets_old_samples():
    clock = Clock()
    fleet = Fleet(FakeLoader(), clock=clock)
    for n in "ab":
        fleet.load(spec(n))
        fleet.wait(n, 10)
    fleet.set_route(route(weights={"a": 1, "b": 1},
                          canary={"incumbent": "a", "min_requests": 5, "window_seconds": 10,
                                  "max_ttft_p99_ratio": 2.0}))
    _traffic(fleet, clock, "a", 10)
    _traffic(fleet, clock, "b", 10, ttft=0.15)  # 1.5x: within the ratio
    assert fleet.route("r").weight("b") == 1
    clock.now += 60  # everything above left the window
    _traffic(fleet, clock, "b", 10, ttft=1.0)
    assert fleet.route("r").weight("b") == 1  # no incumbent samples in the window: no verdict
    window = fleet.route_info("r")["versions"]["b"]["window"]
    assert window["requests"] == 10 and window["ttft_p99_seconds"] == pytest.approx(1.0)


def test_canary_gate_trips_at_the_slo_burn_rate_that_pages(caplog):
    """availability_objective: a version whose availability SLI (5xx bad, 4xx left out) burns
    its budget faster than max_burn_rate over the window trips on its own, whatever the
    incumbent does; the client's own errors never count."""
    clock = Clock()
    fleet = Fleet(FakeLoader(), clock=clock)
    for n in "ab":
        fleet.load(spec(n))
        fleet.wait(n, 10)
    fleet.set_route(route(weights={"a": 9, "b": 1}, canary={
        "incumbent": "a", "min_requests": 10, "window_seconds": 600,
        "max_error_rate_ratio": False, "max_ttft_p99_ratio": False, "max_cost_ratio": False,
        "availability_objective": 0.99, "max_burn_rate": 14.4}))
    _traffic(fleet, clock, "a", 20, availability="bad")  # the incumbent is not judged
    _traffic(fleet, clock, "b", 40, availability="excluded")  # 4xx: no budget spent
    _traffic(fleet, clock, "b", 86)
    _traffic(fleet, clock, "b", 14, availability="bad")  # 14 % bad: burn 14 < 14.4
    assert fleet.route("r").weight("b") == 1
    assert fleet.route_info("r")["versions"]["b"]["window"]["sli_error_ratio"] == 0.14
    _traffic(fleet, clock, "b", 1, availability="bad")  # 15 / 101: burn 14.9
    assert fleet.route("r").weight("b") == 0
    assert [t["reason"] for t in fleet.route_info("r")["canary_trips"]] == [
        "availability_burn_rate"]
    assert "exceeds 14.4x its error budget 0.01" in caplog.text
    with pytest.raises(InvalidRequest, match="availability_objective"):
        route(weights={"a": 1}, canary={"availability_objective": 1.0})


def test_an_open_breaker_sends_the_route_elsewhere_until_a_probe_answers():
    clock = Clock()
    fleet = ready_fleet("a", "b", clock=clock)
    fleet.set_route(route(weights={"a": 1, "b": 1}, breaker={
        "max_error_rate": 0.5, "min_requests": 4, "window_seconds": 60, "open_seconds": 10}))

    def send(n: int, b_fails: bool) -> list[str]:
        chosen = []
        for _ in range(n):
            clock.now += 0.1
            lease = fleet.select("r")
            chosen.append(lease.version.name)
            lease.finish(error=b_fails and lease.version.name == "b")
        return chosen

    first = send(40, b_fails=True)
    assert first[-20:] == ["a"] * 20  # b failed its way open early on
    assert fleet.route_info("r")["versions"]["b"]["breaker"] == {"state": "open", "opened": 1}
    clock.now += 10  # half-open: one probe at a time
    leases = []
    while not leases or leases[-1].version.name != "b":
        leases.append(fleet.select("r"))
    probe = leases.pop()
    assert probe.probe and all(lease.version.name == "a" for lease in leases)
    during = [fleet.select("r") for _ in range(20)]  # the probe is in flight: no second one
    assert {lease.version.name for lease in during} == {"a"}
    for lease in leases + during:
        lease.finish()
    probe.finish(error=True)  # a failed probe opens it again
    assert fleet.route_info("r")["versions"]["b"]["breaker"] == {"state": "open", "opened": 2}
    clock.now += 10
    while (lease := fleet.select("r")).version.name != "b":
        lease.finish()
    with lease:  # a probe that never ran (refused before the engine) frees the probe slot
        pass
    while (lease := fleet.select("r")).version.name != "b":
        lease.finish()
    lease.finish()  # a probe that answers closes it
    assert fleet.route_info("r")["versions"]["b"]["breaker"]["state"] == "closed"
    assert "b" in send(20, b_fails=False)
    # A stalled engine gets no traffic from a route with a breaker while the stall lasts.
    fleet._versions["b"].engine.is_stalled = True
    assert set(send(20, b_fails=False)) == {"a"}
    with pytest.raises(InvalidRequest, match="breaker.max_error_rate"):
        route(breaker={"max_error_rate": 2})
    with pytest.raises(InvalidRequest, match="breaker.open_window"):
        route(breaker={"open_window": 2})

"""Graceful degradation on a route (fleet/degrade.py), end to end on a real server: two versions
of a tiny random model ("big", one sequence at a time and slowed while the test holds it
overloaded, and "small"), the server's shedding threshold at 4 queued sequences, and two routes
that degrade the batch class from 2 queued: `tiny` moves it to "small" and caps it, `capped`
only caps it. Below the threshold nobody is degraded; at it, a batch request is answered by
"small" capped (x-jaxserve-degraded, over gRPC too; the counter by reason, the access and audit
logs) while interactive traffic is not degraded; at the shedding threshold a batch request that
can only be capped is refused 503 as before, and one that can be moved is still answered. Then
the route table's checks, the overload signals read from an engine's numbers, and selection on
fake engines."""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.errors import ConfigError, Conflict, InvalidRequest
from jaxserve.fleet.degrade import DegradeConfig, overload
from jaxserve.fleet.deployment import VersionSpec, parse_deployment, parse_route
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.fleet.fleet import Fleet
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from tests.test_server import ServerThread, _request, queueing_engine, slowable, wait_for

CHAT, BULK = "sk-chat-0123456789abcdefghijklmn", "sk-bulk-0123456789abcdefghijklmn"
TENANTS = f"""
[tenant.chat]
api_keys = ["{CHAT}"]
priority = "interactive"

[tenant.bulk]
api_keys = ["{BULK}"]
priority = "batch"
"""
DEGRADED = "x-jaxserve-degraded"
MAX_QUEUED = 4  # the shedding threshold; the routes degrade from ceil(0.5 * 4) = 2 queued


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    from jaxserve.entrypoints.grpc import start_grpc_server
    from jaxserve.entrypoints.http.app import attach_engine, serving_of
    from tests.test_cli import tiny_gguf

    d = tmp_path_factory.mktemp("degrade")
    (d / "tenants.toml").write_text(TENANTS)
    model = str(tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields))

    big, small = queueing_engine(model), queueing_engine(model)
    fleet = Fleet.of_engine("big", big, max_queued_requests=MAX_QUEUED)
    fleet.adopt(VersionSpec("small", model), small)
    fleet.set_route(parse_route("tiny", {"weights": {"big": 1}, "degrade": {
        "classes": ["batch"], "max_tokens": 4, "degrade_to": "small"}}))
    fleet.set_route(parse_route("capped", {"weights": {"big": 1}, "degrade": {
        "max_tokens": 4}}))
    http = ServerThread("big", tenants_file=str(d / "tenants.toml"),
                        max_queued_requests=MAX_QUEUED, audit_log_dir=str(d / "audit"))
    http.loop.call_soon_threadsafe(lambda: attach_engine(http.app, None, fleet=fleet))
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    grpc_server, port = http._call(start_grpc_server(None, "127.0.0.1", 0, "unused",
                                                     serving=serving_of(http.app)))
    http.grpc_target = f"127.0.0.1:{port}"
    http.big, http.small, http.fleet, http.dir = big, small, fleet, d
    http.slow = slowable(big.engine, 0.25)  # set: each of big's steps takes 250 ms longer
    yield http
    http.slow.clear()
    http._call(grpc_server.stop(grace=None))
    http.stop()
    fleet.shutdown()


def ask(server, key: str, model: str, max_tokens: int = 16):
    return _request("POST", f"{server.url}/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"})


def answered(reply, model: str, tokens: int, degraded: str | None) -> None:
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == model and body["usage"]["completion_tokens"] == tokens, body
    assert reply.headers.get("x-jaxserve-degraded") == degraded, reply.headers


def test_lower_classes_are_degraded_before_anyone_is_shed(server, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    # Not overloaded: a batch request is served as asked.
    answered(ask(server, BULK, "tiny"), "big", 16, None)
    server.slow.set()
    pool = ThreadPoolExecutor(8)
    try:
        # Three long interactive requests: one runs on big, two wait (the degrade threshold).
        fillers = [pool.submit(ask, server, CHAT, "tiny", 80) for _ in range(3)]
        wait_for(lambda: server.big.num_queued == 2 and server.big.stats().num_running == 1,
                 "big to hold 2 queued sequences")
        # Overloaded: batch moves to "small", capped to 4 tokens, with no wait on big.
        answered(ask(server, BULK, "tiny"), "small", 4, "max_tokens,version")
        # The Responses API says so too, whole and streamed, and a replay (Idempotency-Key)
        # says what its original was.
        for path, body in (("/v1/responses", {"model": "tiny", "input": "Say something.",
                                              "max_output_tokens": 16, "temperature": 0}),
                           ("/v1/chat/completions", {
                               "model": "tiny", "max_tokens": 16, "temperature": 0,
                               "messages": [{"role": "user", "content": "Say something."}]})):
            key = {"Authorization": f"Bearer {BULK}", "Idempotency-Key": f"degraded{path}"}
            first = _request("POST", f"{server.url}{path}", body, headers=key)
            replay = _request("POST", f"{server.url}{path}", body, headers=key)
            assert first.status_code == replay.status_code == 200, first.text
            assert replay.headers["idempotent-replayed"] == "true" and replay.text == first.text
            assert first.headers.get(DEGRADED) == replay.headers.get(DEGRADED) \
                == "max_tokens,version", (path, first.headers, replay.headers)
        streamed = _request("POST", f"{server.url}/v1/responses", {
            "model": "tiny", "input": "Say something.", "max_output_tokens": 16, "stream": True},
            headers={"Authorization": f"Bearer {BULK}"})
        assert streamed.status_code == 200 and "event: response.incomplete" in streamed.text
        assert streamed.headers.get(DEGRADED) == "max_tokens,version", streamed.headers
        with grpc.insecure_channel(server.grpc_target) as channel:  # gRPC: trailing metadata
            stream = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                model="tiny", prompt="Hello", max_tokens=16, ignore_eos=True, temperature=0),
                metadata=(("authorization", f"Bearer {BULK}"),))
            deltas = list(stream)
            assert dict(stream.trailing_metadata())["x-jaxserve-degraded"] == "max_tokens,version"
        assert {d.model for d in deltas} == {"small"} and deltas[-1].usage.completion_tokens == 4
        interactive = pool.submit(ask, server, CHAT, "tiny")  # never degraded: waits on big
        wait_for(lambda: server.big.num_queued == 3, "the interactive request to queue")
        capped = pool.submit(ask, server, BULK, "capped")  # capped, on big
        wait_for(lambda: server.big.num_queued == MAX_QUEUED, "big's queue to be full")
        # At the shedding threshold: a batch request that can only be capped is refused as
        # before (nothing less important waits to shed in its place)...
        full = ask(server, BULK, "capped")
        assert full.status_code == 503 and full.json()["error"]["code"] == "overloaded", \
            full.text
        # ...while one its route can move is answered by the smaller version.
        answered(ask(server, BULK, "tiny"), "small", 4, "max_tokens,version")
        server.slow.clear()
        for f in fillers:
            answered(f.result(), "big", 80, None)
        answered(interactive.result(), "big", 16, None)
        answered(capped.result(), "big", 4, "max_tokens")
    finally:
        server.slow.clear()
        pool.shutdown()
    degraded = {tuple(sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(
                    _request("GET", f"{server.url}/metrics").text)
                for s in family.samples if s.name == "jaxserve:requests_degraded_total"}
    assert degraded == {
        (("model_name", "small"), ("reason", "max_tokens"), ("route", "tiny"),
         ("tier", "batch")): 6.0,
        (("model_name", "small"), ("reason", "version"), ("route", "tiny"), ("tier", "batch")): 6.0,
        (("model_name", "big"), ("reason", "max_tokens"), ("route", "capped"),
         ("tier", "batch")): 1.0}, degraded
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "jaxserve.access"]
    degraded = sorted((r["model"], r["route"], tuple(r["degraded"])) for r in records
                      if "degraded" in r)
    assert degraded == [("big", "capped", ("max_tokens",))] + [
        ("small", "tiny", ("max_tokens", "version"))] * 6, records
    audit = server.app[STATE_KEY].policy.audit
    wait_for(lambda: audit.pending == 0, "the audit writer")
    audited = sorted((r["version"], r["route"], tuple(r["degraded"]))
                     for p in sorted((server.dir / "audit").glob("audit-*.jsonl"))
                     for r in map(json.loads, p.read_bytes().splitlines()) if "degraded" in r)
    assert audited == [("big", "/v1/chat/completions", ("max_tokens",))] + [
        ("small", "/v1/chat/completions", ("max_tokens", "version"))] * 3 + [
        ("small", "/v1/responses", ("max_tokens", "version"))] * 2 + [
        ("small", "grpc:Generate", ("max_tokens", "version"))], audited
    # The route as the admin API shows it, degradation included.
    assert server.fleet.route_info("tiny")["degrade"]["degrade_to"] == "small"


def test_the_degrade_table_is_checked_naming_the_field():
    version = {"a": {"model": "m"}, "b": {"model": "m"}}

    def field_of(degrade) -> str:
        with pytest.raises(InvalidRequest) as e:
            parse_deployment({"version": version,
                              "route": {"r": {"weights": {"a": 1}, "degrade": degrade}}})
        return e.value.param

    assert field_of({"classes": ["interactive"], "max_tokens": 8}) == "route.r.degrade.classes"
    assert field_of({"classes": ["batch"]}) == "route.r.degrade"  # degrades to nothing
    assert field_of({"max_tokens": 0}) == "route.r.degrade.max_tokens"
    assert field_of({"degrade_to": "c"}) == "route.r.degrade.degrade_to"
    assert field_of({"max_tokens": 8, "queue_fraction": 1.0}) == "route.r.degrade.queue_fraction"
    assert field_of({"max_tokens": 8, "kv_usage": 0}) == "route.r.degrade.kv_usage"
    assert field_of({"max_tokens": 8, "when": "now"}) == "route.r.degrade.when"
    # A server with no shedding threshold has no queue signal: kv_usage is then required.
    fleet = Fleet.empty()
    with pytest.raises(InvalidRequest, match="no overload signal") as e:
        fleet._check_degrade(parse_route("r", {"weights": {"a": 1},
                                               "degrade": {"max_tokens": 8}}))
    assert e.value.param == "degrade"


def test_a_deployment_file_s_degrade_error_names_file_and_field(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[version.a]\nmodel = "m"\n[route.r]\nweights = { a = 1 }\n'
                    '[route.r.degrade]\nclasses = ["interactive"]\nmax_tokens = 8\n')
    with pytest.raises(ConfigError, match=r"d\.toml: 'route\.r\.degrade\.classes'"):
        Fleet.from_deployment(path)


def test_overload_signals():
    def engine(queued: int, in_use: int = 0):
        stats = SimpleNamespace(pages_in_use=in_use, num_usable_pages=100)
        return SimpleNamespace(num_queued=queued, stats=lambda: stats)

    config = DegradeConfig(max_tokens=8, queue_fraction=0.3)
    assert config.queue_threshold(10) == math.ceil(3.0)
    assert overload(config, engine(2), 10) is None
    assert overload(config, engine(3), 10) == "queue"
    assert overload(config, engine(99), None) is None  # no shedding threshold, no kv_usage
    with_kv = DegradeConfig(max_tokens=8, kv_usage=0.9)
    assert overload(with_kv, engine(0, 89), None) is None
    assert overload(with_kv, engine(0, 90), None) == "kv_cache"
    assert DegradeConfig(max_tokens=8).queue_threshold(1) == 1  # never above the threshold
    assert not DegradeConfig(max_tokens=8, classes=("batch",)).applies(-1)
    assert DegradeConfig(max_tokens=8, classes=("batch", "standard")).applies(0)


def test_selection_degrades_only_listed_classes_of_an_overloaded_version():
    from jaxserve.core.request import ServiceClass
    from jaxserve.fleet.degrade import Degradation
    from tests.test_fleet import ready_fleet

    fleet = ready_fleet("big", "small", max_queued_requests=4)
    engines = fleet.engines()  # test_fleet's fakes, given the numbers overload() reads
    for e in engines.values():
        e.num_queued = 0
    fleet.set_route(parse_route("r", {"weights": {"big": 1}, "breaker": {}, "degrade": {
        "max_tokens": 8, "degrade_to": "small"}}))

    def pick(priority):
        with fleet.select("r", priority=priority) as lease:
            return lease.version.name, lease.degradation

    assert pick(ServiceClass.BATCH) == ("big", None)  # 0 queued: not overloaded
    engines["big"].num_queued = 2
    assert pick(ServiceClass.BATCH) == ("small", Degradation("queue", 8, moved_from="big"))
    for priority in (ServiceClass.STANDARD, ServiceClass.INTERACTIVE, None):
        assert pick(priority) == ("big", None)  # not a class the route degrades
    engines["small"].is_stalled = True  # degrade_to cannot take it: only capped
    assert pick(ServiceClass.BATCH) == ("big", Degradation("queue", 8))
    with pytest.raises(Conflict, match="route"):  # the route may send it traffic
        fleet.unload("small")
    fleet.shutdown()

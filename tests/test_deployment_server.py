"""Serving through the fleet, end to end: one server over a deployment file of two SmolLM2
versions whose manifests differ (the GGUF, and the same GGUF with a system-prompt default), its
admin API and gRPC.

The weighted split's statistics use the routing function directly (200 users); real requests
check that the server routes the same way, that one user keeps one version, that every answer
carries its version's `system_fingerprint`, that versions are addressable by name, that a shadow
copy never reaches the client and is counted and compared, that weight changes and rollbacks
while 16 streams run fail none of them, and that an unload drains. Plus the admin API's 401 and a
malformed deployment file failing `jaxserve serve` with one line naming the field. And, on a tiny
model, structured-output and forced-tool-call requests shadowed like any other.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.loader import EngineLoader
from jaxserve.fleet.manifest import FileHashCache
from jaxserve.fleet.routing import Route, choose, sticky_unit
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.entrypoints.http.admin_routes import add_admin_routes
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import attach_engine, serving_of
from jaxserve.entrypoints.serving.shadow import token_agreement
from tests.test_cli import ROOT
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, _request, parse_sse, wait_for

SMOLLM2 = "smollm2-135m-instruct"
KEY = "admin-s3cret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You answer in one word."
# Few, small programs to compile: 4 sequences a step, 64 tokens a step, a 256-token context,
# steps of at least 16 tokens (the fleet is the subject here, not small steps: conftest.py).
ENGINE = ("max_model_len = 256\nmax_num_seqs = 4\nmax_num_batched_tokens = 64\nnum_pages = 96\n"
          "min_token_bucket = 16\n")
DEPLOYMENT = f"""
[version.smol-a]
model = "{SMOLLM2}"
{ENGINE}
[version.smol-b]
model = "{SMOLLM2}"
{ENGINE}
[version.smol-b.generation]
system_prompt = "{SYSTEM}"

[route.smollm2]
weights = {{ smol-a = 50, smol-b = 50 }}
sticky = "user"

[route.shadowed]
weights = {{ smol-a = 1 }}
shadow = {{ smol-b = 1.0 }}
"""


# ---------------------------------------------------------------- routing, without a server


def test_weighted_split_is_within_statistical_bounds_and_sticky():
    route = Route("r", (("v1", 90.0), ("v2", 10.0)), "user")
    users = [f"user-{i}" for i in range(200)]
    picks = {u: choose(route, sticky_unit("r", u), lambda v: True) for u in users}
    n2 = sum(v == "v2" for v in picks.values())
    # Binomial(200, 0.1): mean 20, sd 4.24; 4 sd either side fails a correct split ~1e-4 times.
    assert abs(n2 - 20) <= 4 * math.sqrt(200 * 0.1 * 0.9), n2
    # Sticky: the same user, the same version, every time (and in every process: sha256).
    assert all(choose(route, sticky_unit("r", u), lambda v: True) == picks[u] for u in users)
    # A weight change moves only the users it must: 90/10 -> 80/20 keeps every v2 user on v2.
    wider = Route("r", (("v1", 80.0), ("v2", 20.0)), "user")
    assert all(choose(wider, sticky_unit("r", u), lambda v: True) == "v2"
               for u in users if picks[u] == "v2")


def test_token_agreement():
    assert token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 2, 9]) == 0.5
    assert token_agreement([], []) == 1.0


def test_a_malformed_deployment_file_is_one_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEPLOYMENT.replace('sticky = "user"', 'sticky = "cookie"'))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "serve", "--deployment", str(bad), "--port", "0",
         "--no-rag"], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "route.smollm2.sticky" in errors[0] and str(bad) in errors[0], \
        proc.stderr[-2000:]
    both = subprocess.run(
        [sys.executable, "-m", "jaxserve", "serve", "--deployment", str(bad), "--model",
         SMOLLM2, "--port", "0", "--no-rag"], cwd=ROOT, env=dict(os.environ),
        capture_output=True, text=True, timeout=300)
    assert both.returncode == 1 and "either --model" in both.stderr


# ---------------------------------------------------------------- one server, two versions


class Server:
    def __init__(self, http: ServerThread, fleet: Fleet, grpc_target: str):
        self.http, self.fleet, self.url, self.grpc_target = http, fleet, http.url, grpc_target

    def post(self, body, path="/v1/chat/completions"):
        return _request("POST", f"{self.url}{path}", body)

    def admin(self, method: str, path: str, body=None, headers=ADMIN):
        return _request(method, f"{self.url}/admin/v1{path}", body, headers=headers)

    def fingerprint(self, version: str) -> str:
        return self.admin("GET", f"/versions/{version}").json()["system_fingerprint"]

    def idle(self) -> None:
        for engine in self.fleet.engines().values():
            wait_for(lambda: not engine.engine.has_unfinished() and engine.num_queued == 0,
                     "the engine to go idle")
            assert_no_leaks(engine.engine)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("deployment") / "deployment.toml"
    path.write_text(DEPLOYMENT)
    hashes = FileHashCache(tmp_path_factory.mktemp("hashes") / "hashes.json")
    fleet = Fleet.from_deployment(path, EngineLoader(strict_compile=True, hashes=hashes))
    http = ServerThread(str(path), setup=lambda app: add_admin_routes(app, fleet, KEY))
    http.loop.call_soon_threadsafe(lambda: attach_engine(http.app, None, fleet=fleet))
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    grpc_server, port = http._call(start_grpc_server(None, "127.0.0.1", 0, "unused",
                                                     serving=serving_of(http.app)))
    yield Server(http, fleet, f"127.0.0.1:{port}")
    http._call(grpc_server.stop(grace=None))
    http.stop()
    runners = [e.engine.runner for e in fleet.engines().values()]
    fleet.shutdown()
    assert all(r.num_serving_compiles == 0 for r in runners)


def chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 6, **fields}


@pytest.mark.slow
def test_models_list_routes_and_versions_with_distinct_fingerprints(server):
    models = {m["id"]: m for m in _request("GET", f"{server.url}/v1/models").json()["data"]}
    assert set(models) == {"smollm2", "shadowed", "smol-a", "smol-b"}
    assert models["smollm2"]["route"] == {"weights": {"smol-a": 50.0, "smol-b": 50.0},
                                          "sticky": "user"}
    a, b = models["smol-a"]["system_fingerprint"], models["smol-b"]["system_fingerprint"]
    assert a.startswith("fp_") and b.startswith("fp_") and a != b
    assert (a, b) == (server.fingerprint("smol-a"), server.fingerprint("smol-b"))


@pytest.mark.slow
def test_versions_by_name_answer_with_their_fingerprint_and_defaults(server):
    for version in ("smol-a", "smol-b"):
        reply = server.post(chat("Name a color.", model=version))
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == version
        assert body["system_fingerprint"] == server.fingerprint(version)
        # Streams carry it on every chunk, as OpenAI's do.
        chunks = parse_sse(server.post(chat("Name a color.", model=version, stream=True,
                                            stream_options={"include_usage": True}))
                           .text.encode())
        assert {c["system_fingerprint"] for c in chunks} == {server.fingerprint(version)}
        assert {c["model"] for c in chunks} == {version}
    # smol-b's default system prompt opens a chat that brings none: the same answer as giving it.
    given = server.post({**chat("Name a color.", model="smol-a"), "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]})
    defaulted = server.post(chat("Name a color.", model="smol-b"))
    assert given.json()["choices"][0]["message"] == defaulted.json()["choices"][0]["message"]
    assert defaulted.json()["usage"]["prompt_tokens"] == given.json()["usage"]["prompt_tokens"]
    plain = server.post(chat("Name a color.", model="smol-a")).json()  # the template's own system
    assert plain["usage"]["prompt_tokens"] != given.json()["usage"]["prompt_tokens"]
    # gRPC: every message says the version and its fingerprint.
    with grpc.insecure_channel(server.grpc_target) as channel:
        deltas = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            model="smol-b", prompt="Hello", max_tokens=4, temperature=0)))
        listed = pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest())
    assert deltas and {(d.model, d.system_fingerprint) for d in deltas} == {
        ("smol-b", server.fingerprint("smol-b"))}
    assert {m.id: m.system_fingerprint for m in listed.models}["smol-a"] == \
        server.fingerprint("smol-a")
    assert server.post(chat("Hi", model="smol-c")).status_code == 404
    server.idle()


@pytest.mark.slow
def test_a_route_sends_each_user_where_the_routing_function_does_every_time(server):
    route = server.fleet.route("smollm2")
    users = [f"user-{i}" for i in range(6)]
    expected = {u: choose(route, sticky_unit("smollm2", u), lambda v: True) for u in users}
    assert set(expected.values()) == {"smol-a", "smol-b"}  # these six users meet both
    for _ in range(2):  # the second round: the same user, the same version
        for user in users:
            body = server.post(chat("Hi", model="smollm2", user=user, max_tokens=2)).json()
            assert body["model"] == expected[user]
            assert body["system_fingerprint"] == server.fingerprint(expected[user])
    # OpenAI's prompt_cache_key is the sticky key, winning over `user`
    for user in users:
        body = server.post(chat("Hi", model="smollm2", user="someone", prompt_cache_key=user,
                                max_tokens=1)).json()
        assert body["model"] == expected[user]
    server.idle()


def _samples(url: str, name: str) -> dict[tuple, float]:
    text = _request("GET", f"{url}/metrics").text
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


@pytest.mark.slow
def test_shadow_copies_never_reach_the_client_and_are_compared(server):
    before = server.fleet.counters().get(("shadowed", "smol-b"))
    before = before.shadow_compared if before else 0
    for stream in (False, True):
        reply = server.post(chat("Name a fruit.", model="shadowed", stream=stream))
        assert reply.status_code == 200
        assert "smol-b" not in reply.text and server.fingerprint("smol-b") not in reply.text
    # The copies answer after the client has its answer; both counted and compared (greedy,
    # the same weights and prompt: the same tokens).
    counters = wait_for(lambda: (c := server.fleet.counters().get(("shadowed", "smol-b")))
                        and c.shadow_compared >= before + 2 and c, "the shadow copies")
    assert counters.requests == 0 and counters.shadow_errors == 0
    assert counters.shadow_token_agreement_sum == counters.shadow_compared  # agreement 1.0
    labels = (("model_name", "smol-b"), ("route", "shadowed"))
    assert _samples(server.url, "jaxserve:shadow_token_agreement")[labels] == 1.0
    assert _samples(server.url, "jaxserve:shadow_requests_total")[labels] >= 2
    # Per-version labels on the request metrics: the primary was smol-a through "shadowed".
    ttft = _samples(server.url, "jaxserve:time_to_first_token_seconds_count")
    assert ttft[(("model_name", "smol-a"), ("route", "shadowed"), ("tenant", "default"))] >= 2
    server.idle()


@pytest.mark.slow
def test_admin_routes_need_the_key(server):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        reply = server.admin("GET", "/routes", headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert server.admin("GET", "/routes").status_code == 200


@pytest.mark.slow
def test_weight_changes_and_rollbacks_during_16_streams_fail_none(server):
    results: list = [None] * 16

    def stream(i: int) -> None:
        results[i] = server.post(chat("Count to twenty.", model="smollm2", user=f"s{i}",
                                      stream=True, max_tokens=24, ignore_eos=True))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(v["in_flight"] for v in server.fleet.versions_info()) >= 8,
             "the streams to start")
    changes = [("PUT", {"weights": {"smol-a": 100, "smol-b": 0}}), ("POST", None),
               ("PUT", {"weights": {"smol-a": 0, "smol-b": 100}}), ("POST", None)]
    for method, body in changes:
        path = "/routes/smollm2" if method == "PUT" else "/routes/smollm2/rollback"
        assert server.admin(method, path, body).status_code == 200
        if method == "PUT":  # applies at once to new requests
            only = max(body["weights"], key=body["weights"].get)
            assert server.post(chat("Hi", model="smollm2", user="new", max_tokens=1)
                               ).json()["model"] == only
    for t in threads:
        t.join(300)
    for reply in results:
        assert reply is not None and reply.status_code == 200
        chunks = parse_sse(reply.text.encode())
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len({c["model"] for c in chunks}) == 1  # one version answered each stream
    # Each rollback undid the change before it: the weights are as the file set them.
    assert dict(server.fleet.route("smollm2").weights) == {"smol-a": 50.0, "smol-b": 50.0}
    server.idle()


@pytest.mark.slow
def test_unload_drains_in_flight_requests(server):  # last: smol-b is gone afterwards
    assert server.admin("DELETE", "/versions/smol-b").status_code == 409  # still routed to
    for route, body in (("smollm2", {"weights": {"smol-a": 1, "smol-b": 0}}),
                        ("shadowed", {"shadow": {}})):
        assert server.admin("PUT", f"/routes/{route}", body).status_code == 200
    result: list = []
    t = threading.Thread(target=lambda: result.append(server.post(
        chat("Count to ten.", model="smol-b", stream=True, max_tokens=24, ignore_eos=True))))
    t.start()
    wait_for(lambda: server.fleet.version_info("smol-b")["in_flight"] == 1, "the stream")
    reply = server.admin("DELETE", "/versions/smol-b")
    assert reply.status_code == 202 and reply.json()["state"] == "draining"
    assert server.post(chat("Hi", model="smol-b")).status_code == 404  # new requests: elsewhere
    t.join(300)
    chunks = parse_sse(result[0].text.encode())
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the in-flight one finished
    wait_for(lambda: server.fleet.version_info("smol-b")["state"] == "unloaded", "the unload")
    assert "smol-b" not in {m["id"] for m in
                            _request("GET", f"{server.url}/v1/models").json()["data"]}
    assert server.post(chat("Hi", model="smollm2", user="x", max_tokens=1)).json()["model"] \
        == "smol-a"



# ---------------------------------------------------------------- shadows of constrained requests


def test_structured_output_and_forced_tool_call_requests_are_shadowed(
        tmp_path, smollm2_tokenizer_fields):
    """A constrained request is copied like any other: the shadow version's engine compiles
    the constraint for its own tokenizer and its greedy answer is compared with the primary's
    (a tiny model; two versions over one engine)."""
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from jaxserve.fleet.deployment import VersionSpec
    from jaxserve.entrypoints.serving.calls import Call
    from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
    from tests.test_cli import tiny_gguf

    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields,
                     max_position_embeddings=256)
    llm = build_engine(str(path), num_pages=48, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=256,
                       min_token_bucket=16, strict_compile=True, progress=False)
    engine = AsyncEngine(llm)
    fleet = Fleet.of_engine("v-a", engine)
    fleet.adopt(VersionSpec("v-b", "tiny"), engine)
    fleet.set_route(Route("shadowed", (("v-a", 1.0),), shadow=(("v-b", 1.0),)))
    tool = {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    greedy = {"model": "shadowed", "temperature": 0, "max_tokens": 24}
    requests = [
        ("completion", {**greedy, "prompt": "Pick", "structured_outputs": {
            "choice": ["yes", "no"]}}),
        ("chat", {**greedy, "messages": [{"role": "user", "content": "Pick"}], "tools": [tool],
                  "tool_choice": {"type": "function", "function": {"name": "noop"}}}),
    ]

    async def run() -> list[dict]:
        serving = OpenAIServing(None, "tiny", fleet=fleet)
        answers = []
        for kind, body in requests:
            gen = await serving.prepare_async(kind, body, serving.open_context("http"),
                                              Call(serving.sinks))
            async with gen.running():
                answers.append(await gen.response())
        # the copies run in the background, after their primaries' admission
        for _ in range(600):
            counters = fleet.counters().get(("shadowed", "v-b"))
            if counters is not None and counters.shadow_compared == 2:
                break
            await asyncio.sleep(0.1)
        return answers

    try:
        text, tool_call = asyncio.run(run())
        assert text["choices"][0]["text"] in ("yes", "no")
        assert tool_call["choices"][0]["finish_reason"] == "tool_calls"
        counters = fleet.counters()[("shadowed", "v-b")]
        assert (counters.shadow_requests, counters.shadow_compared, counters.shadow_errors,
                counters.requests) == (2, 2, 0, 0)
    finally:
        engine.shutdown()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


# ---------------------------------------------------------------- a data-parallel version


def test_a_data_parallel_version_is_a_replica_set(tmp_path, smollm2_tokenizer_fields):
    """data_parallel_size in a deployment file: the version loads through the engine factory as
    one replica per device (2 virtual CPU devices), each with the pool the fleet planned."""
    from jaxserve.entrypoints.process import ServerProcess
    from tests.test_cli import tiny_gguf
    from tests.test_parallel import assert_clean_log, devices_env, per_replica

    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    deployment = tmp_path / "deployment.toml"
    deployment.write_text(f'[version.dp]\nmodel = "{path}"\ndata_parallel_size = 2\n'
                          'max_model_len = 128\nnum_pages = 32\nmax_num_seqs = 4\n'
                          'max_num_batched_tokens = 16\nmin_token_bucket = 16\n')
    with (tmp_path / "stderr.log").open("w") as log:
        server = ServerProcess(["--deployment", str(deployment), "--admin-key", KEY, "--no-rag",
                                "--port", "0"], log, cwd=ROOT, env=devices_env(2))
        try:
            base = server.url.removesuffix("/v1")
            reply = _request("POST", f"{server.url}/completions",
                             {"model": "dp", "prompt": [3, 4, 5], "max_tokens": 4})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            memory = _request("GET", f"{base}/admin/v1/versions/dp",
                              headers=ADMIN).json()["memory"]
            assert (memory["replicas"], memory["num_pages"]) == (2, 32)
            assert set(per_replica(f"{base}/metrics", "jaxserve:num_requests_running")) == {
                "0", "1"}
            assert server.stop() == 0
        finally:
            server.kill()
    assert_clean_log((tmp_path / "stderr.log").read_text())

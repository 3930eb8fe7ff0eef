"""The front door end to end on the real server (SmolLM2), one module-scoped HTTP + gRPC server
with a tenants file: 401s on every route but the open ones, 404 for a model a tenant may not
use, 429 with Retry-After and OpenAI's x-ratelimit-* headers, Idempotency-Key replay (the model
does not run again), 409 / 422, deadlines (504 before bytes, one error event mid-stream),
shedding order on a full queue, the gRPC equivalents, usage cost, per-tenant metrics and access
log, the batch runner as a tenant, and the same limits on tokenize, embeddings, rerank and the
collection routes (and gRPC Embed). After each test every KV page is back in the pool."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.entrypoints.batch import answer_items, batch_gateway, read_input
from jaxserve.core.engine_factory import build_engine
from jaxserve.errors import ConfigError
from jaxserve.gateway.pricing import Pricing
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.rag.config import EMBEDDING_MODEL, ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import attach_engine, serving_of
from tests.rag_helpers import tiny_embedder
from tests.test_engine import assert_no_leaks
from tests.test_server import (Reply, ServerThread, _request, access_records, parse_sse,
                               wait_for)

SMOLLM2 = "smollm2-135m-instruct"
PRICES = Pricing(prompt_per_1m=1.5, completion_per_1m=4.0)
TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]
priority = "interactive"
weight = 4

[tenant.bob]
api_keys = ["sk-bob"]
requests_per_minute = 2
tokens_per_minute = 100000

[tenant.carol]
api_key_sha256 = ["{carol_digest}"]
models = ["other-*"]

[tenant.dave]
api_keys = ["sk-dave"]
priority = "batch"
max_tokens_cap = 8

[tenant.erin]
api_keys = ["sk-erin"]

[tenant.frank]
api_keys = ["sk-frank"]
requests_per_minute = 2

[tenant.grace]
api_keys = ["sk-grace"]
tokens_per_minute = 30
"""
CHAT = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Name a color."}],
        "temperature": 0, "max_tokens": 8}
# Runs until its deadline (or the test ends it): 480 tokens take many seconds on a CPU.
LONG = {"model": SMOLLM2, "prompt": "Count:", "max_tokens": 480, "ignore_eos": True}


def post(url: str, body, key: str | None = None, **headers) -> Reply:
    """POST as `key`; headers given as Python names (X_Request_Timeout)."""
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    return _request("POST", url, body, headers=hdrs)


def get(url: str, key: str | None = None) -> Reply:
    return _request("GET", url, headers={"Authorization": f"Bearer {key}"} if key else None)


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def metric_values(url: str) -> dict[tuple, float]:
    """/metrics as {(sample name, sorted labels without model_name/route/replica): value}."""
    values = {}
    for family in text_string_to_metric_families(get(f"{url}/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "route", "replica")))
            # Summed over versions: a request refused before one was chosen has model_name "".
            values[(s.name, labels)] = values.get((s.name, labels), 0.0) + s.value
    return values


def generated(url: str) -> float:
    return metric_values(url)[("jaxserve:generation_tokens_total", ())]


class Server:
    def __init__(self, http: ServerThread, engine: AsyncEngine, grpc_target: str, tenants_path):
        self.http, self.engine, self.grpc_target = http, engine, grpc_target
        self.tenants_path = tenants_path
        self.url = http.url
        self.llm = engine.engine

    def idle(self) -> None:
        """No request left in the engine, every page back (pool invariant checked)."""
        wait_for(lambda: not self.llm.has_unfinished() and self.engine.num_queued == 0
                 and self.engine.stats().pages_in_use == 0, "the engine to go idle")
        assert_no_leaks(self.llm)

    def stub(self):
        return pb_grpc.GenerationStub(grpc.insecure_channel(self.grpc_target))


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from jaxserve.gateway.tenants import hash_key

    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS.format(carol_digest=hash_key("sk-carol").hex()))
    # One sequence slot and a queue of two: the shedding test fills both with one request each.
    llm = build_engine(SMOLLM2, num_pages=128, max_num_seqs=1,
                       max_num_batched_tokens=256, max_model_len=512,
                       min_token_bucket=16, strict_compile=True, progress=False)
    engine = AsyncEngine(llm)
    # The retrieval routes (embeddings, collections) with the tiny random encoder.
    rag = RagService(RagConfig(tmp_path_factory.mktemp("rag"),
                               EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)), tiny_embedder())
    http = ServerThread(SMOLLM2, rag, tenants_file=str(path), max_queued_requests=2)
    http.loop.call_soon_threadsafe(attach_engine, http.app, engine, None, PRICES)
    wait_for(lambda: get(f"{http.url}/ready").status_code == 200, "ready")
    grpc_server, port = http._call(start_grpc_server(engine, "127.0.0.1", 0, SMOLLM2, rag=rag,
                                                     serving=serving_of(http.app)))
    srv = Server(http, engine, f"127.0.0.1:{port}", path)
    yield srv
    http._call(grpc_server.stop(grace=None))
    http.stop()
    engine.shutdown()
    rag.close()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


@pytest.mark.slow
def test_keys_guard_every_route_but_the_open_ones(server):
    url = server.url
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert get(f"{url}{path}").status_code == 200, path
    for key in (None, "sk-nobody"):
        for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"model": SMOLLM2, "prompt": "a"}),
                                   ("POST", "/tokenize", {"prompt": "a"}),
                                   ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/v1/models", None)):
            r = post(url + path, body, key) if method == "POST" else get(url + path, key)
            assert r.status_code == 401, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and "sk-nobody" not in err["message"]
    # a key stored only as its sha256 digest works; its tenant may not use this model: 404
    assert get(f"{url}/v1/models", "sk-carol").json()["data"] == []
    r = post(f"{url}/v1/chat/completions", CHAT, "sk-carol")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert [m["id"] for m in get(f"{url}/v1/models", "sk-alice").json()["data"]] == [SMOLLM2]
    stub = server.stub()
    request = pb.GenerateRequest(model=SMOLLM2, prompt="a", max_tokens=2)
    for metadata in ((), (("authorization", "Bearer sk-nobody"),)):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.ListModels(pb.ListModelsRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    server.idle()


@pytest.mark.slow
def test_rate_limit_429_with_headers_then_grpc_resource_exhausted(server):
    url = server.url
    # bob: 2 requests per minute
    replies = [post(f"{url}/v1/chat/completions", CHAT, "sk-bob") for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 429]
    for r in replies:
        h = r.headers
        assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-limit-tokens"] == "100000"
        assert {"x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests",
                "x-ratelimit-reset-tokens"} <= set(h)
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["1", "0", "0"]
    err = replies[2].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    # one request per 30 s refills: the retry passes within that
    assert 1 <= int(replies[2].headers["retry-after"]) <= 30
    # the tokens reserved at admission were settled with those used
    assert int(replies[1].headers["x-ratelimit-remaining-tokens"]) > 100000 - 2 * 100
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub().Generate(pb.GenerateRequest(model=SMOLLM2, prompt="a", max_tokens=2),
                                    metadata=(("authorization", "Bearer sk-bob"),)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= int(dict(info.value.trailing_metadata())["retry-after"]) <= 30
    # tenant-labelled outcomes
    m = metric_values(url)
    assert m[("jaxserve:requests_total", (("outcome", "ok"), ("tenant", "bob")))] == 2
    assert m[("jaxserve:requests_total",
              (("outcome", "429_rate_limit_exceeded"), ("tenant", "bob")))] == 2
    server.idle()


# Every keyed route that works for a tenant beside generation: (method, path, body).
WORK_ROUTES = [
    ("POST", "/tokenize", {"prompt": "a"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "Paris"}),
    ("POST", "/v1/rerank", {"query": "capital", "documents": ["Paris", "bread"]}),
    ("POST", "/v1/collections", {"name": "kb"}),
    ("GET", "/v1/collections", None),
    ("POST", "/v1/collections/kb/documents", {"documents": [{"id": "d", "text": "Paris"}]}),
    ("POST", "/v1/collections/kb/search", {"query": "Paris", "mode": "bm25"}),
    ("DELETE", "/v1/collections/kb/documents/d", None),
    ("DELETE", "/v1/collections/kb", None),
]


def call(url: str, method: str, path: str, body, key: str) -> Reply:
    return _request(method, url + path, body, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.slow
def test_tokenize_embeddings_and_collections_count_against_the_same_limits(server):
    url = server.url
    # frank: 2 requests per minute, whatever the route; then a 429 on every route
    assert [call(url, *WORK_ROUTES[0], "sk-frank").status_code for _ in range(2)] == [200, 200]
    for method, path, body in [*WORK_ROUTES, ("POST", "/v1/chat/completions", CHAT)]:
        r = call(url, method, path, body, "sk-frank")
        assert r.status_code == 429, (path, r.text)
        assert r.json()["error"]["code"] == "rate_limit_exceeded", path
        assert 1 <= int(r.headers["retry-after"]) <= 30, path
        assert (r.headers["x-ratelimit-limit-requests"],
                r.headers["x-ratelimit-remaining-requests"]) == ("2", "0"), path
    embed = pb.EmbedRequest(model=EMBEDDING_MODEL, input=["Paris"])
    with pytest.raises(grpc.RpcError) as info:
        server.stub().Embed(embed, metadata=(("authorization", "Bearer sk-frank"),))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 1 <= int(dict(info.value.trailing_metadata())["retry-after"]) <= 30
    # another tenant is unaffected: every route answers it
    for method, path, body in WORK_ROUTES:
        r = call(url, method, path, body, "sk-erin")
        assert r.status_code in (200, 201), (path, r.text)
    server.stub().Embed(embed, metadata=(("authorization", "Bearer sk-erin"),))
    m = metric_values(url)  # gRPC Embed's 429 is counted as HTTP's are
    assert m[("jaxserve:requests_total",
              (("outcome", "429_rate_limit_exceeded"), ("tenant", "frank")))] == 12
    # grace: 30 tokens per minute. An embedding is charged the tokens the encoder read (its
    # usage), into debt; the next encoder call and generation wait it out, tokenize does not.
    r = call(url, "POST", "/v1/embeddings",
             {"model": EMBEDDING_MODEL, "input": "Paris is lovely. " * 10}, "sk-grace")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 30
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    for method, path, body in (WORK_ROUTES[2], WORK_ROUTES[3],
                               ("POST", "/v1/chat/completions", CHAT)):
        r = call(url, method, path, body, "sk-grace")
        assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"], path
        assert int(r.headers["retry-after"]) >= 1
    assert call(url, *WORK_ROUTES[0], "sk-grace").status_code == 200
    server.idle()


@pytest.mark.slow
def test_idempotent_replay_conflict_and_mismatch(server):
    url, key = server.url, {"Idempotency_Key": "order-1"}
    first = post(f"{url}/v1/chat/completions", CHAT, "sk-alice", **key)
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    before = generated(url)
    again = post(f"{url}/v1/chat/completions", CHAT, "sk-alice", **key)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()  # same id, text and usage
    assert generated(url) == before  # the model did not run again
    # usage carries the cost at the model's prices
    usage = first.json()["usage"]
    assert usage["cost"] == pytest.approx((usage["prompt_tokens"] * 1.5
                                           + usage["completion_tokens"] * 4.0) / 1e6)
    # another tenant's same key is another request
    assert "idempotent-replayed" not in post(f"{url}/v1/chat/completions", CHAT, "sk-erin",
                                             **key).headers
    # the same key with another body: 422
    r = post(f"{url}/v1/chat/completions", {**CHAT, "max_tokens": 7}, "sk-alice", **key)
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
    # streaming replays the same events as SSE
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    s1 = post(f"{url}/v1/chat/completions", stream, "sk-alice", Idempotency_Key="order-2")
    before = generated(url)
    s2 = post(f"{url}/v1/chat/completions", stream, "sk-alice", Idempotency_Key="order-2")
    assert s2.headers["idempotent-replayed"] == "true"
    assert s2.headers["content-type"].startswith("text/event-stream")
    assert parse_sse(s2.text.encode()) == parse_sse(s1.text.encode())
    assert generated(url) == before
    # while the first is still running: 409; once it failed (its deadline), a retry runs again
    long = {"Idempotency_Key": "order-3", "X_Request_Timeout": "4"}
    t, out = in_thread(lambda: post(f"{url}/v1/completions", LONG, "sk-alice", **long))
    wait_for(lambda: server.engine.stats().num_running == 1, "the first request to run")
    r = post(f"{url}/v1/completions", LONG, "sk-alice", **long)
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_conflict"
    t.join(60)
    assert out[0].status_code == 504
    server.idle()


@pytest.mark.slow
def test_deadline_504_before_bytes_and_error_event_mid_stream(server):
    url = server.url
    # The one seat is taken, so these queue (an idle engine may start a request within 1 ms).
    blocker, _ = in_thread(lambda: post(f"{url}/v1/completions", LONG, "sk-alice",
                                        X_Request_Timeout="4"))
    wait_for(lambda: server.engine.stats().num_running == 1, "the long request to run")
    for stream in (False, True):  # expired before it could start: a plain 504 either way
        r = post(f"{url}/v1/completions", {**LONG, "stream": stream}, "sk-alice",
                 X_Request_Timeout="0.001")
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded"
    blocker.join()
    server.idle()
    r = post(f"{url}/v1/completions", LONG, "sk-alice", X_Request_Timeout="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
    # a stream that started ends with one error event, then [DONE]; its pages come back
    r = post(f"{url}/v1/completions", {**LONG, "stream": True}, "sk-alice",
             X_Request_Timeout="3")
    assert r.status_code == 200
    events = parse_sse(r.text.encode())
    assert any(e.get("choices") and e["choices"][0]["text"] for e in events[:-1])
    assert events[-1]["error"]["code"] == "deadline_exceeded"
    assert sum("error" in e for e in events) == 1
    server.idle()
    # gRPC: the call's own deadline
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub().Generate(pb.GenerateRequest(model=SMOLLM2, prompt="Count:",
                                                       max_tokens=480, ignore_eos=True),
                                    metadata=(("authorization", "Bearer sk-alice"),),
                                    timeout=1.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.idle()
    m = metric_values(url)
    assert m[("jaxserve:requests_total", (("outcome", "deadline"), ("tenant", "alice")))] >= 3


@pytest.mark.slow
def test_full_queue_sheds_lowest_class_newest_first(server):
    """One seat, a queue of two sequences. While alice's long request runs, dave (batch) and erin
    (standard) wait; an interactive request then displaces dave's (503 + Retry-After, nothing
    generated), the next one erin's; a batch request finding no lower class is refused itself."""
    url = server.url
    small = {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 4}
    running, _ = in_thread(lambda: post(f"{url}/v1/completions", LONG, "sk-alice",
                                        X_Request_Timeout="12"))
    wait_for(lambda: server.engine.stats().num_running == 1, "the long request to run")
    waiting = []
    for key in ("sk-dave", "sk-erin"):
        waiting.append(in_thread(lambda key=key: post(f"{url}/v1/completions", small, key)))
        n = len(waiting)
        wait_for(lambda: server.engine.stats().num_waiting == n, f"{key} to queue")
    displacing = [in_thread(lambda: post(f"{url}/v1/completions", small, "sk-alice"))]
    waiting[0][0].join(60)
    dave = waiting[0][1][0]
    assert dave.status_code == 503 and dave.json()["error"]["code"] == "overloaded"
    assert int(dave.headers["retry-after"]) >= 1
    assert waiting[1][0].is_alive()  # erin still waits
    wait_for(lambda: server.engine.stats().num_waiting == 2, "alice's request to queue")
    displacing.append(in_thread(lambda: post(f"{url}/v1/completions", small, "sk-alice")))
    waiting[1][0].join(60)
    assert waiting[1][1][0].status_code == 503
    wait_for(lambda: server.engine.stats().num_waiting == 2, "alice's second request to queue")
    r = post(f"{url}/v1/completions", small, "sk-dave")  # nothing below batch to shed
    assert r.status_code == 503 and "queue is full" in r.json()["error"]["message"]
    # the long request ends at its deadline; the displacing ones then run
    running.join(60)
    for t, out in displacing:
        t.join(60)
        assert out[0].status_code == 200
    m = metric_values(url)
    assert m[("jaxserve:requests_total", (("outcome", "shed"), ("tenant", "dave")))] == 2
    assert m[("jaxserve:requests_total", (("outcome", "shed"), ("tenant", "erin")))] == 1
    server.idle()


@pytest.mark.slow
def test_grpc_shares_the_access_log_and_tenant_metrics(server, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    before = metric_values(server.url)
    deltas = list(server.stub().Generate(
        pb.GenerateRequest(model=SMOLLM2, prompt="Hi", max_tokens=3, ignore_eos=True),
        metadata=(("authorization", "Bearer sk-erin"),)))
    assert deltas[-1].usage.completion_tokens == 3
    record, = wait_for(lambda: access_records(caplog, 1), "the access-log line")
    assert record["transport"] == "grpc" and record["tenant"] == "erin"
    assert record["key_id"] and len(record["key_id"]) == 12 and "sk-erin" not in json.dumps(record)
    after = metric_values(server.url)
    erin = (("tenant", "erin"),)
    assert after[("jaxserve:tenant_generation_tokens_total", erin)] - before.get(
        ("jaxserve:tenant_generation_tokens_total", erin), 0) == 3
    assert after[("jaxserve:time_to_first_token_seconds_count", erin)] > before.get(
        ("jaxserve:time_to_first_token_seconds_count", erin), 0)
    assert after[("jaxserve:cost_usd_total", erin)] > 0
    server.idle()


@pytest.mark.slow
def test_batch_runner_as_a_tenant(server, tmp_path):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**CHAT, "max_tokens": m}} for i, m in enumerate((4, 8, 9))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path = server.tenants_path  # the server's file, as `jaxserve batch --tenants` reads it
    with pytest.raises(ConfigError, match="unknown tenant 'zed'"):
        batch_gateway(path, "zed")
    with pytest.raises(ConfigError, match="--tenant"):
        batch_gateway(path, None)
    gateway, principal = batch_gateway(path, "dave")
    asyncio.run_coroutine_threadsafe(
        answer_items(server.engine, SMOLLM2, read_input(inp), out, gateway, principal),
        server.http.loop).result(120)
    results = {r["custom_id"]: r["response"] for r in map(json.loads,
                                                          out.read_text().splitlines())}
    assert results["r0"]["status_code"] == results["r1"]["status_code"] == 200
    # dave's max_tokens_cap is 8
    assert results["r2"]["status_code"] == 400
    assert results["r2"]["body"]["error"]["param"] == "max_tokens"
    server.idle()


def test_flags_reach_the_server_config_and_a_bad_file_fails_at_start(tmp_path):
    from jaxserve.entrypoints.cli import build_parser, main
    from jaxserve.config import ServerConfig
    from jaxserve.entrypoints.http.app import build_app
    from jaxserve.entrypoints.launcher import server_config

    args = build_parser().parse_args(["serve", "--model", SMOLLM2, "--tenants", "t.toml",
                                      "--idempotency-ttl", "60"])
    config = server_config(args)
    assert (config.tenants_file, config.idempotency_ttl_s) == ("t.toml", 60.0)
    assert server_config(build_parser().parse_args(["serve", "--model", SMOLLM2])) \
        .idempotency_ttl_s == 24 * 3600
    args = build_parser().parse_args(["batch", "--model", SMOLLM2, "--input", "i", "--output",
                                      "o", "--tenants", "t.toml", "--tenant", "acme"])
    assert (str(args.tenants), args.tenant) == ("t.toml", "acme")
    bad = tmp_path / "tenants.toml"
    bad.write_text('[tenant.acme]\napi_keys = ["k"]\nrequests_per_minute = -1\n')
    with pytest.raises(ConfigError, match=r"tenants.toml: tenant.acme.requests_per_minute"):
        build_app(ServerConfig(port=0, tenants_file=str(bad)), SMOLLM2)
    # the batch runner refuses it before any model loads: one line, exit status 1
    assert main(["batch", "--model", SMOLLM2, "--input", str(bad), "--output",
                 str(tmp_path / "o.jsonl"), "--tenants", str(bad), "--tenant", "acme"]) == 1

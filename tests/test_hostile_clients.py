"""Clients that misbehave, against a real server (review a70e490: H1, H3, M8): a stream the
client stops reading, a client that leaves while its grammar compiles, and refused requests
that used to cost nothing and ran their heavy preparation on the event loop.

One module-scoped server over a tiny random model with SmolLM2's tokenizer, a tenants file and a
one-second stream write timeout. The compile and the prompt preparation can be held on an event
(`gate_prepare`), so the windows these bugs lived in are made deterministic."""

from __future__ import annotations

import asyncio
import importlib
import socket
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import serving_of
from jaxserve.entrypoints.serving import protocol
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.entrypoints.serving.streams import merge_streams
from tests.test_cli import ROOT, tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, slowable, wait_for
from tests.test_tenancy_server import metric_values, post

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.solo]
api_keys = ["sk-solo"]
max_concurrent_requests = 1

[tenant.rpm]
api_keys = ["sk-rpm"]
requests_per_minute = 2
"""
MAX_LEN = 1024


def _soak():
    """benchmarks/soak.py, whose raw client the tests share (it imports its siblings)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("soak")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


raw_post = _soak().raw_post


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("hostile")
    (d / "tenants.toml").write_text(TENANTS)
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=MAX_LEN)
    # One sequence and one token bucket: little to compile.
    llm = build_engine(str(path), num_pages=80, max_num_seqs=1, max_num_batched_tokens=16,
                       max_model_len=MAX_LEN, min_token_bucket=16, strict_compile=True,
                       progress=False)
    engine = AsyncEngine(llm)
    http = ServerThread("tiny", tenants_file=str(d / "tenants.toml"),
                        stream_write_timeout_s=1.0)
    http.slow = slowable(llm, 0.02)  # set: each engine step takes 20 ms longer
    try:
        # Small socket buffers (accepted sockets inherit the listener's): a client that stops
        # reading stalls the server's writes after a few dozen chunks, not megabytes.
        for site in http.runner.sites:
            for sock in site._server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        http.attach(engine)
        grpc_server, port = http._call(start_grpc_server(
            None, "127.0.0.1", 0, "unused", serving=serving_of(http.app), write_timeout_s=1.0))
        http.engine, http.llm, http.grpc_target = engine, llm, f"127.0.0.1:{port}"
        yield http
        http._call(grpc_server.stop(grace=None))
    finally:
        http.stop()
        engine.shutdown()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


@pytest.fixture
def slowed(server):
    """Steps of 20 ms: the 960 tokens a stalled stream asks for take ~20 s, far past the 1 s write
    timeout (at full speed the tiny model once made them all before the timeout fired)."""
    server.slow.set()
    yield
    server.slow.clear()


def requests_total(url: str, tenant: str, outcome: str) -> float:
    return metric_values(url).get(
        ("jaxserve:requests_total", (("outcome", outcome), ("tenant", tenant))), 0.0)


def idle(server) -> bool:
    s = server.engine.stats()
    return not server.llm.has_unfinished() and s.pages_in_use == 0 and s.num_running == 0


@pytest.fixture
def gate_prepare(server, monkeypatch):
    """Hold `protocol.prompt_ids` (template render + tokenize) and the engine's `prepare` (the
    grammar compile) of requests whose user text starts with "HOLD" until `release` is set."""
    gate = type("Gate", (), {})()
    gate.started, gate.release, gate.finished = (threading.Event(), threading.Event(),
                                                 threading.Event())
    prompt_ids, prepare = protocol.prompt_ids, server.engine.prepare

    def held_prompt_ids(tokenizer, parsed, prompt):
        if parsed.kind == "chat" and str(prompt[-1]["content"]).startswith("HOLD"):
            gate.started.set()
            assert gate.release.wait(30)
        return prompt_ids(tokenizer, parsed, prompt)

    def held_prepare(request_id, prompt, params=None, *args, **kwargs):
        try:
            return prepare(request_id, prompt, params, *args, **kwargs)
        finally:
            if params is not None and params.structured_outputs is not None:
                gate.finished.set()

    monkeypatch.setattr(protocol, "prompt_ids", held_prompt_ids)
    monkeypatch.setattr(server.engine, "prepare", held_prepare)
    yield gate
    gate.release.set()


def test_merged_streams_pull_no_further_than_their_reader():
    """n prompts' streams merged into one: a reader that stops makes the pumps stop too (they
    used to drain every engine stream into an unbounded queue)."""
    pulled = [0, 0]

    async def source(i):
        for _ in range(1000):
            pulled[i] += 1
            yield i
            await asyncio.sleep(0)

    async def main():
        merged = merge_streams([source(0), source(1)])
        await merged.__anext__()
        for _ in range(50):
            await asyncio.sleep(0)
        await merged.aclose()

    asyncio.run(main())
    assert sum(pulled) <= 4, pulled


def test_a_stream_nobody_reads_is_ended_and_its_pages_freed(server, slowed):
    """Review H1: a client that never reads a long stream (top-20 logprobs on every token) is
    cut off once a write has stalled for the write timeout: the request is aborted in the
    engine (pages back), its call ends as client_disconnected, long before it would finish."""
    url = server.url
    before = requests_total(url, "alice", "client_disconnected")
    body = {"model": "tiny", "stream": True, "max_tokens": MAX_LEN - 64,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": "hi"}]}
    sock = raw_post(url, "/v1/chat/completions", body, rcvbuf=4096, key="sk-alice")
    try:
        wait_for(lambda: server.engine.stats().num_running, "the request to run")
        wait_for(lambda: requests_total(url, "alice", "client_disconnected") > before,
                 "the stalled stream to be ended", deadline_s=30)
        wait_for(lambda: idle(server), "its pages to come back")
        generated = metric_values(url)[("jaxserve:generation_tokens_total", ())]
        assert generated < MAX_LEN - 64  # aborted, not run to the end
        # The server closed the connection: reading now reaches its end.
        sock.settimeout(10)
        try:
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    assert_no_leaks(server.llm)


def test_a_grpc_stream_nobody_reads_is_ended_and_its_pages_freed(server, slowed):
    """Review H1 on gRPC: HTTP/2 flow control stops the server's writes to a client that reads
    nothing (a small window here); once one has waited the write timeout the call ends
    UNAVAILABLE and the request is aborted, its pages back, long before it would finish."""
    url = server.url
    before = requests_total(url, "alice", "client_disconnected")
    channel = grpc.insecure_channel(server.grpc_target, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    try:
        stream = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(model="tiny", prompt="hi", max_tokens=MAX_LEN - 64,
                               ignore_eos=True),
            metadata=(("authorization", "Bearer sk-alice"),))
        wait_for(lambda: requests_total(url, "alice", "client_disconnected") > before,
                 "the stalled gRPC stream to be ended", deadline_s=30)
        wait_for(lambda: idle(server), "its pages to come back")
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
    assert_no_leaks(server.llm)


def test_leaving_while_the_grammar_compiles_takes_nothing_from_the_tenant(server, gate_prepare):
    """Review H3: solo may run one sequence at a time. It sends a constrained request and leaves
    while the request is being prepared; once the preparation ends anyway, its next request must
    still be admitted (the orphaned preparation used to take the tenant's slot for good)."""
    url = server.url
    schema = {"type": "object", "properties": {"held": {"type": "integer"}}}
    body = {"model": "tiny", "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}},
            "messages": [{"role": "user", "content": "HOLD and leave"}]}
    before = requests_total(url, "solo", "client_disconnected")
    sock = raw_post(url, "/v1/chat/completions", body, key="sk-solo")
    assert gate_prepare.started.wait(30)
    sock.close()
    wait_for(lambda: requests_total(url, "solo", "client_disconnected") > before,
             "the server to see the client leave")
    gate_prepare.release.set()
    assert gate_prepare.finished.wait(30)
    time.sleep(0.2)  # what the orphaned preparation did after its compile
    r = post(f"{url}/v1/chat/completions",
             {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
             "sk-solo")
    assert r.status_code == 200, r.text
    wait_for(lambda: idle(server), "the engine to go idle")


def test_preparing_a_prompt_leaves_the_event_loop_free(server, gate_prepare):
    """Review M8: the template render and tokenization of a large prompt run off the event loop:
    while one is held, the server still answers."""
    url = server.url
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "HOLD " + "word " * 20_000}]}
    sock = raw_post(url, "/v1/chat/completions", body, key="sk-alice")
    try:
        assert gate_prepare.started.wait(30)
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200
    finally:
        gate_prepare.release.set()
        sock.close()
    wait_for(lambda: idle(server), "the engine to go idle")


def test_refused_requests_count_against_the_request_rate(server):
    """Review M8: rpm may send 2 requests a minute. Two refused ones (context length) use them
    up: the third, valid, is refused by the rate limit before its prompt is tokenized."""
    url = server.url
    too_long = {"model": "tiny", "max_tokens": MAX_LEN + 1,
                "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        r = post(f"{url}/v1/chat/completions", too_long, "sk-rpm")
        assert r.status_code == 400, r.text
    r = post(f"{url}/v1/chat/completions",
             {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
             "sk-rpm")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text

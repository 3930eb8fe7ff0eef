"""Clients that misbehave, against a real server (review a70e490: H1): a stream the client stops
reading.

One module-scoped server over a tiny random model with SmolLM2's tokenizer, a tenants file and a
one-second stream write timeout."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.serving.streams import merge_streams
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, wait_for
from tests.test_tenancy_server import metric_values

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
    try:
        # Small socket buffers (accepted sockets inherit the listener's): a client that stops
        # reading stalls the server's writes after a few dozen chunks, not megabytes.
        for site in http.runner.sites:
            for sock in site._server.sockets:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        http.attach(engine)
        http.engine, http.llm = engine, llm
        yield http
    finally:
        http.stop()
        engine.shutdown()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def requests_total(url: str, tenant: str, outcome: str) -> float:
    return metric_values(url).get(
        ("jaxserve:requests_total", (("outcome", outcome), ("tenant", tenant))), 0.0)


def idle(server) -> bool:
    s = server.engine.stats()
    return not server.llm.has_unfinished() and s.pages_in_use == 0 and s.num_running == 0


def raw_post(url: str, path: str, body: dict, key: str, rcvbuf: int | None = None) -> socket.socket:
    """Send a request on a raw socket and read nothing (a tiny receive buffer: the server's
    writes stall as soon as the kernel buffers fill)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                 + data)
    return sock


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


def test_a_stream_nobody_reads_is_ended_and_its_pages_freed(server):
    """Review H1: a client that never reads a long stream (top-20 logprobs on every token) is
    cut off once a write has stalled for the write timeout: the request is aborted in the
    engine (pages back), its call ends as client_disconnected, long before it would finish."""
    url = server.url
    before = requests_total(url, "alice", "client_disconnected")
    body = {"model": "tiny", "stream": True, "max_tokens": MAX_LEN - 64,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": "hi"}]}
    sock = raw_post(url, "/v1/chat/completions", body, "sk-alice", rcvbuf=4096)
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

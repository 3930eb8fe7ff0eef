"""`jaxserve serve` as an operator runs it (a child process, tiny random model), under abuse: a
short run of benchmarks/soak.py (normal chats, cut streams, clients that give up, hostile bodies)
must end clean, and then a deliberately wedged engine must turn /ready and gRPC health not-ready,
log the engine thread's stack, and still let SIGTERM end the process (status 1: wedged).

The two share one server; the wedge test ends it, so it comes last."""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.entrypoints.process import ServerProcess
from jaxserve.entrypoints.http.sse import sse
from tests.serve_wedgeable import WEDGE_SEED
from tests.test_cli import ROOT, tiny_gguf
from tests.test_server import http_get, http_post, wait_for

TINY = "tiny"
STALL_S, SHUTDOWN_S = 2, 3
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    tmp = tmp_path_factory.mktemp("soak")
    path = tiny_gguf(tmp / "tiny.gguf", smollm2_tokenizer_fields)
    log_path = tmp / "stderr.log"
    with log_path.open("w") as stderr:
        srv = ServerProcess(
            ["--model", str(path), "--served-model-name", TINY, "--port", "0", "--grpc-port",
             "0", "--no-rag", "--max-model-len", "128", "--num-pages", "64", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
             "--engine-stall-timeout", str(STALL_S),
             "--shutdown-timeout", str(SHUTDOWN_S), "--max-body-bytes", str(MAX_BODY)],
            stderr, cwd=ROOT, ready_timeout_s=600, module="tests.serve_wedgeable")
        srv.log_path = log_path
        srv.grpc_target = next(line.split(" on ", 1)[1].strip() for line in srv.startup_lines
                               if line.startswith("jaxserve: gRPC on "))
        try:
            yield srv
        finally:
            srv.kill()


def test_the_soak_tells_an_error_event_from_a_token_that_reads_error(monkeypatch):
    # A random model may stream the token "error", `"content":"error"` in the bytes (the likely
    # cause of a CI failure whose server logged no traceback): only a payload with a top-level
    # "error" is an error event.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    soak = importlib.import_module("soak")
    chunk = {"choices": [{"index": 0, "delta": {"content": "error"}, "finish_reason": None}]}
    stream = b"".join(sse(p) for p in (chunk, "[DONE]"))
    assert soak._error_event(stream) is None
    error = {"error": {"message": "boom", "type": "server_error", "code": None}}
    stream = b"".join(sse(p) for p in (chunk, error, "[DONE]"))
    assert json.loads(soak._error_event(stream)) == error


def test_a_short_soak_ends_every_request_once_and_leaves_the_server_idle(server):
    proc = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--base-url", server.url, "--model", TINY,
         "--num-requests", "160", "--concurrency", "16", "--seed", "3",
         "--max-body-bytes", str(MAX_BODY), "--server-log", str(server.log_path),
         "--grpc-target", server.grpc_target, "--embed-calls", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and report["passed"], (report["problems"], proc.stderr[-3000:])
    # Every kind was tried, the hostile ones all refused with a 4xx.
    assert set(report["by_kind"]) >= {"chat", "stream", "stream_cut", "give_up", "n_huge",
                                      "deep_json", "surrogate"}
    for kind in ("n_huge", "deep_json", "surrogate"):
        assert report["http_statuses"][kind] == {"400": report["by_kind"][kind]["4xx"]}
    # Hostile gRPC Embed calls (--no-rag here: UNIMPLEMENTED, and the oversized message refused).
    assert report["by_kind"]["embed_many"] == report["by_kind"]["embed_oversize"] == {"4xx": 1}
    assert report["ends"].get("answer", 0) > 0 and report["server_log"]["lines"] > 0
    assert report["idle_after"] == {"num_requests_running": 0, "num_requests_waiting": 0,
                                    "kv_cache_usage_perc": 0}


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30).status


def test_a_wedged_engine_is_not_ready_and_sigterm_still_ends_the_process(server):
    base = server.url.removesuffix("/v1")
    assert http_get(f"{base}/ready").json() == {"status": "ready"}
    assert _health(server.grpc_target) == health_pb2.HealthCheckResponse.SERVING
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def stuck():  # its step never returns; the connection ends with the process
        with contextlib.suppress(OSError, http.client.HTTPException):
            http_post(f"{server.url}/chat/completions", {**body, "seed": WEDGE_SEED})

    threading.Thread(target=stuck, daemon=True).start()
    wait_for(lambda: http_get(f"{base}/ready").status_code == 503, "/ready to turn 503")
    assert http_get(f"{base}/ready").json() == {"status": "engine stalled"}
    assert _health(server.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
    r = http_post(f"{server.url}/chat/completions", body)  # refused, not queued behind it
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    wait_for(lambda: "engine stalled" in server.log_path.read_text(), "the stall to be logged")

    server.proc.send_signal(signal.SIGTERM)
    # Drain (SHUTDOWN_S), then 5 s for the engine thread: the process must not outlive that by
    # much, whatever its engine does. (A deadline, not a measurement.)
    code = server.proc.wait(timeout=SHUTDOWN_S + 5 + 30)
    log = server.log_path.read_text()
    assert code == 1, log[-3000:]
    stall = log[log.index("engine stalled"):]
    assert "step_or_wedge" in stall  # the engine thread's stack, where it hangs
    assert "the engine thread did not stop" in log

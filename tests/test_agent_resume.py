"""A background agent run survives a SIGKILL: a server subprocess (tests/serve_agents.py: an engine
that stops a few steps into its third request, the tiny random encoder) runs a response with
file_search (tool_choice required, max_tool_calls 4); the test kills it with SIGKILL once 2 of the
4 tool calls have completed and the next model turn is held mid-way, restarts it (without the
hold) on the same data directory, and the run finishes:
its step log shows every step once, each tool call executed exactly once, the interrupted model
turn run again, and `jaxserve audit verify` passes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from jaxserve.agents.store import FILE_NAME
from jaxserve.entrypoints.process import ServerProcess
from tests.serve_agents import HOLD_REQUEST_ENV
from tests.test_cli import ROOT, tiny_gguf
from tests.test_server import _request, wait_for

pytestmark = pytest.mark.slow


def _steps(data_dir, rid) -> list[tuple]:
    path = data_dir / FILE_NAME
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT position, kind, status, attempts, step_id FROM steps WHERE "
                          "response_id=? ORDER BY position", (rid,)).fetchall()
    except sqlite3.OperationalError:  # the schema is not there yet
        return []
    finally:
        db.close()


def test_a_background_run_resumes_after_sigkill(tmp_path, smollm2_tokenizer_fields):
    model = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields,
                      max_position_embeddings=1024)
    data, audit = tmp_path / "data", tmp_path / "audit"
    args = ["--model", str(model), "--served-model-name", "tiny", "--port", "0",
            "--max-model-len", "1024", "--num-pages", "80", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "32", "--min-token-bucket", "16",
            "--data-dir", str(data), "--audit-log", str(audit)]

    def start(log_name: str, **env: str) -> ServerProcess:
        with (tmp_path / log_name).open("w") as stderr:
            return ServerProcess(args, stderr, cwd=ROOT, module="tests.serve_agents",
                                 ready_timeout_s=600, env={**os.environ, **env})

    # The run's model turns are its requests to the engine: the third is the one after 2 tool calls.
    server = start("first.log", **{HOLD_REQUEST_ENV: "3"})
    try:
        base = server.url.removesuffix("/v1")
        assert _request("POST", f"{base}/v1/collections", {"name": "notes"}).status_code == 201
        r = _request("POST", f"{base}/v1/collections/notes/documents", {"documents": [
            {"id": "cats", "text": "Cats sleep most of the day."},
            {"id": "dogs", "text": "Dogs like long walks."}]})
        assert r.status_code == 200, r.text
        r = _request("POST", f"{base}/v1/responses", {
            "model": "tiny", "input": "What do cats do?", "background": True,
            "tools": [{"type": "file_search", "vector_store_ids": ["notes"],
                       "max_num_results": 1}],
            "tool_choice": "required", "max_tool_calls": 4, "max_output_tokens": 128,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        rid = r.json()["id"]

        def third_turn_running():
            steps = _steps(data, rid)
            assert not (len(steps) > 5 or steps and steps[-1][2] != "started"
                        and len(steps) == 5), f"the run went past the kill point: {steps}"
            return len(steps) == 5 and steps[4][1:3] == ("model_turn", "started")

        wait_for(third_turn_running, "2 tool calls done and the third turn held", 300)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
    finally:
        server.kill()
    before = _steps(data, rid)
    assert [s[1:3] for s in before[:4]] == [("model_turn", "completed"),
                                            ("tool_call", "completed")] * 2

    server = start("second.log")
    try:
        base = server.url.removesuffix("/v1")
        done = wait_for(lambda: (lambda b: b if b["status"] not in ("queued", "in_progress")
                                 else None)(_request("GET", f"{base}/v1/responses/{rid}").json()),
                        "the resumed run to end", 300)
        # (the random model's answer may run to max_output_tokens: incomplete)
        assert done["status"] in ("completed", "incomplete"), done
        kinds = [item["type"] for item in done["output"]]
        assert kinds.count("file_search_call") == 4 and kinds[-1] == "message", kinds
    finally:
        server.stop()
    steps = _steps(data, rid)
    # Every step once, in order, completed; the tool calls each executed once; the model turn
    # the kill interrupted ran a second time.
    assert [(p, k, s) for p, k, s, _, _ in steps] == [
        (i, "model_turn" if i % 2 == 0 else "tool_call", "completed") for i in range(9)]
    assert [a for _, k, _, a, _ in steps if k == "tool_call"] == [1, 1, 1, 1]
    assert steps[4][3] == 2
    assert len({s[4] for s in steps}) == 9
    started = [json.loads(line) for path in sorted(audit.glob("audit-*.jsonl"))
               for line in path.read_text().splitlines()]
    tool_starts = [r["step_id"] for r in started if r.get("type") == "step"
                   and r["step_kind"] == "tool_call" and r["status"] == "started"]
    assert sorted(tool_starts) == sorted(s[4] for s in steps if s[1] == "tool_call")
    proc = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "audit", "verify",
                           str(audit)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""OpenAI's Batch API (/v1/files, /v1/batches) on the real server: the official `openai` client's
flow (upload, create, retrieve, content, cancel) over chat, completions, embeddings and responses
lines;
another tenant's files and batches are 404s; bad input is a 4xx naming the field, or a failed
batch naming each bad line (as OpenAI validates); a cancelled and an expired batch keep their
partial output; and `jaxserve serve` killed with SIGKILL mid-batch resumes it on restart,
running every line exactly once (counted in the access logs of both processes). `jaxserve eval
run` with a `via = "batch"` version sends lm-eval's requests as a batch here, resumes it after the
runner is killed, and stores the live route's scores."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys

import openai
import pytest

from jaxserve.batches.config import BatchLimits
from jaxserve.batches.service import BatchService
from jaxserve.batches.store import BatchStore
from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.batch_lines import ServingLines
from jaxserve.entrypoints.cli import main
from jaxserve.entrypoints.http.app import serving_of
from jaxserve.entrypoints.http.batch_routes import add_batch_routes
from jaxserve.entrypoints.http.responses_routes import response_runner
from jaxserve.entrypoints.process import ServerProcess
from jaxserve.evals.store import open_store
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from tests.rag_helpers import tiny_embedder
from tests.test_cli import ROOT, tiny_gguf
from tests.test_server import ServerThread, slowable, wait_for

KEYS = {"acme": "sk-acme-0123456789abcdef0123", "globex": "sk-globex-0123456789abcdef01",
        "metered": "sk-metered-0123456789abcdef0"}


def _line(custom_id: str, url: str = "/v1/chat/completions", **body) -> dict:
    if url == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": f"hi {custom_id}"}], **body}
    elif url == "/v1/completions":
        body = {"prompt": f"once {custom_id}", **body}
    elif url == "/v1/responses":
        body = {"input": f"hi {custom_id}", **body}
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "tiny", **body}}


def _jsonl(lines) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    data = tmp_path_factory.mktemp("batches")
    tenants = data / "tenants.toml"
    tenants.write_text("".join(f'[tenant.{name}]\napi_keys = ["{key}"]\n'
                               for name, key in KEYS.items())
                       + "requests_per_minute = 3\n")  # metered's
    rag = RagService(RagConfig(data / "rag", EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)),
                     tiny_embedder())
    # One line at a time: a cancel or the end of a short window finds lines left to cut off.
    batches = BatchService(BatchStore(data), BatchLimits(max_file_lines=16,
                                                         max_concurrent_lines=1))
    srv = ServerThread("tiny", rag=rag, setup=lambda app: add_batch_routes(app, batches),
                       tenants_file=str(tenants))
    llm = build_engine(str(tiny_path), num_pages=48, max_num_seqs=4, max_num_batched_tokens=32,
                       max_model_len=128, min_token_bucket=16, progress=False)
    srv.slow = slowable(llm, 0.05)  # set: each engine step takes 50 ms longer
    engine = AsyncEngine(llm)
    srv.attach(engine)
    srv._call(_start(batches, srv.app, rag))
    srv.batches = batches
    yield srv
    srv._call(batches.stop())
    srv.stop()
    engine.shutdown()
    rag.close()


async def _start(batches: BatchService, app, rag) -> None:
    """On the server's loop, after the engine's attach (queued before it): the runner is set."""
    batches.start(ServingLines(serving_of(app), rag, response_runner(app)))


def _client(server, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[tenant], max_retries=0)


def _ended(client: openai.OpenAI, batch_id: str, deadline_s: float = 300):
    return wait_for(lambda: (b := client.batches.retrieve(batch_id)).status in (
        "completed", "failed", "expired", "cancelled") and b, f"batch {batch_id} to end",
        deadline_s)


def _results(client: openai.OpenAI, batch) -> list[dict]:
    out = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            out += [json.loads(t) for t in client.files.content(file_id).text.splitlines()]
    return out


def test_openai_client_flow_chat_completions_embeddings_and_responses(server):
    client = _client(server)
    lines = [_line(f"c{i}", max_tokens=4, temperature=0) for i in range(3)]
    lines.append(_line("bad-temp", temperature=-1))  # the request path's 400, in the error file
    up = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    assert (up.object, up.purpose, up.bytes, up.filename) == ("file", "batch",
                                                              len(_jsonl(lines)), "in.jsonl")
    assert client.files.retrieve(up.id).id == up.id
    created = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"run": "t1"})
    assert created.status == "validating" and created.metadata == {"run": "t1"}
    batch = _ended(client, created.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert batch.model == "tiny" and batch.in_progress_at and batch.completed_at
    assert 0 < batch.usage.output_tokens <= 12 and batch.usage.input_tokens > 0
    out = [json.loads(t) for t in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2"]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    (err,) = [json.loads(t) for t in client.files.content(batch.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad-temp" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "temperature"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert created.id in [b.id for b in client.batches.list(limit=5)]

    # /v1/completions and /v1/embeddings lines, the same way
    for url, obj in (("/v1/completions", "text_completion"), ("/v1/embeddings", "list")):
        body = {"input": "some text"} if url == "/v1/embeddings" else {"max_tokens": 2}
        model = {"model": "all-minilm-l6-v2"} if url == "/v1/embeddings" else {}
        up = client.files.create(file=("x.jsonl", _jsonl([_line(f"{url}-{i}", url, **body,
                                                                **model) for i in range(2)])),
                                 purpose="batch")
        b = _ended(client, client.batches.create(input_file_id=up.id, endpoint=url,
                                                 completion_window="24h").id)
        assert b.status == "completed" and b.request_counts.completed == 2, b
        assert {r["response"]["body"]["object"] for r in _results(client, b)} == {obj}
    assert client.files.delete(up.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)

    # /v1/responses: the line's body is the response, run as POST /v1/responses with store
    # false (not retrievable); a body the Responses request model refuses is a 400 naming it.
    url = "/v1/responses"
    up = client.files.create(file=("r.jsonl", _jsonl([
        _line("r0", url, max_output_tokens=4, temperature=0), _line("r-bad", url, input=[]),
        _line("r-bg", url, background=True)])),
        purpose="batch")
    b = _ended(client, client.batches.create(input_file_id=up.id, endpoint=url,
                                             completion_window="24h").id)
    assert b.status == "completed" and b.model == "tiny", b
    assert b.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    ok, *errs = _results(client, b)
    body = ok["response"]["body"]
    assert ok["custom_id"] == "r0" and ok["response"]["request_id"] == body["id"]
    assert (body["object"], body["store"]) == ("response", False), body
    assert body["status"] in ("completed", "incomplete") and body["output"]
    assert 0 < body["usage"]["output_tokens"] <= 4
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(body["id"])
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["param"])
            for e in errs] == [("r-bad", 400, "input"), ("r-bg", 400, "background")]


def test_another_tenants_files_and_batches_are_404(server):
    acme, globex = _client(server), _client(server, "globex")
    up = acme.files.create(file=("in.jsonl", _jsonl([_line("a", max_tokens=1)])),
                           purpose="batch")
    batch = acme.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    for call in (lambda: globex.files.retrieve(up.id), lambda: globex.files.content(up.id),
                 lambda: globex.files.delete(up.id), lambda: globex.batches.retrieve(batch.id),
                 lambda: globex.batches.cancel(batch.id),
                 lambda: globex.batches.create(input_file_id=up.id, completion_window="24h",
                                               endpoint="/v1/chat/completions")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert up.id not in [f.id for f in globex.files.list()]
    assert batch.id not in [b.id for b in globex.batches.list()]
    assert _ended(acme, batch.id).status == "completed"


def test_lines_count_against_the_tenants_limits_through_the_python_entry_point(server):
    """Three lines of a tenant allowed three requests a minute take all three: its next live
    request is refused (the lines are submitted through BatchService, not the rate-limited
    routes, as the eval pipeline submits)."""
    async def run():
        batch = await server.batches.submit("metered", [_line(str(i), max_tokens=1)
                                                        for i in range(3)],
                                            "/v1/chat/completions")
        batch = await server.batches.wait("metered", batch["id"])
        return batch, await server.batches.results("metered", batch)

    batch, results = server._call(run())
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    assert sorted(r["custom_id"] for r in results) == ["0", "1", "2"]
    with pytest.raises(openai.RateLimitError):
        _client(server, "metered").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def test_bad_input_is_a_4xx_naming_the_field_or_a_failed_batch_naming_the_line(server):
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as e:  # over --batch-max-file-lines (16 here)
        client.files.create(file=("x.jsonl", _jsonl([_line(str(i)) for i in range(17)])),
                            purpose="batch")
    assert e.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"\xff\xfe\n"), purpose="batch")
    assert e.value.body["param"] == "file"
    up = client.files.create(file=("x.jsonl", _jsonl([_line("a", max_tokens=1)])),
                             purpose="batch")
    for kwargs, param in (({"completion_window": "25x"}, "completion_window"),
                          ({"endpoint": "/v1/moderations"}, "endpoint"),
                          ({"metadata": {"k": "v" * 513}}, "metadata"),
                          ({"input_file_id": ""}, "input_file_id")):
        args = {"input_file_id": up.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(**args)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=0)

    # Lines that cannot make a batch: it fails, naming each (OpenAI's validation errors).
    bad = [_line("a"), "{not json", _line("b", url="/v1/completions"), _line("a"),
           {"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {}}]
    up = client.files.create(file=("bad.jsonl", _jsonl(bad)), purpose="batch")
    batch = _ended(client, client.batches.create(input_file_id=up.id, completion_window="24h",
                                                 endpoint="/v1/chat/completions").id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "invalid_json_line", None), (3, "url_mismatch", "url"),
        (4, "duplicate_custom_id", "custom_id"), (5, "invalid_request", "method")]
    with pytest.raises(openai.ConflictError):  # an ended batch cannot be cancelled
        client.batches.cancel(batch.id)


def _each_line_once(client, batch, total: int) -> list[dict]:
    results = _results(client, batch)
    assert sorted(r["custom_id"] for r in results) == sorted(str(i) for i in range(total))
    assert batch.request_counts.completed + batch.request_counts.failed == total
    return results


def test_cancel_and_expiry_keep_partial_output(server):
    client = _client(server)
    lines = [_line(str(i), max_tokens=64, temperature=0) for i in range(16)]
    up = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
             "a line to finish", 300)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = _ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    results = _each_line_once(client, batch, 16)
    unrun = [r for r in results if r["error"] is not None]
    assert 1 <= batch.request_counts.completed < 16 and unrun
    assert {r["error"]["code"] for r in unrun} == {"batch_cancelled"}

    # Slowed, the 16 lines' 1,024 steps take over 50 s: a 2 s window ends with lines left (at
    # full speed they once all ended inside it).
    server.slow.set()
    try:
        batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                      completion_window="2s")
        batch = _ended(client, batch.id)
    finally:
        server.slow.clear()
    assert batch.status == "expired" and batch.expired_at, batch
    results = _each_line_once(client, batch, 16)
    assert {r["error"]["code"] for r in results if r["error"]} == {"batch_expired"}


# ---------------------------------------------------------------- SIGKILL and resume


def _serve(tiny_path, data, log):
    return ServerProcess(["--model", str(tiny_path), "--served-model-name", "tiny", "--port",
                          "0", "--no-rag", "--data-dir", str(data), "--max-model-len", "128",
                          "--num-pages", "32", "--max-num-seqs", "2",
                          "--max-num-batched-tokens", "16", "--min-token-bucket", "16",
                          "--batch-max-concurrent-lines", "2"], log, cwd=ROOT,
                         ready_timeout_s=600)


def _batch_executions(log_path) -> dict[str, str]:
    """request id -> status of each batch line the server's access log recorded."""
    out = {}
    for text in log_path.read_text().splitlines():
        if "jaxserve.access: " in text:
            record = json.loads(text.split("jaxserve.access: ", 1)[1])
            if record["transport"] == "batch":
                out[record["request_id"]] = record["status"]
    return out


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_runs_every_line_exactly_once(tiny_path, tmp_path):
    data, total = tmp_path / "data", 12
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    with logs[0].open("w") as log:
        first = _serve(tiny_path, data, log)
        try:
            client = openai.OpenAI(base_url=first.url, api_key="unused", max_retries=0)
            up = client.files.create(file=("in.jsonl", _jsonl(
                [_line(str(i), max_tokens=64, temperature=0) for i in range(total)])),
                purpose="batch")
            batch_id = client.batches.create(input_file_id=up.id, completion_window="24h",
                                             endpoint="/v1/chat/completions").id
            wait_for(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 3,
                     "three lines to finish", 300)
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
        finally:
            first.kill()
    store = BatchStore(data)
    done = store.done_lines(batch_id)
    assert store.batch(None, batch_id)["status"] == "in_progress"
    store.close()
    assert 3 <= len(done) < total

    with logs[1].open("w") as log:
        second = _serve(tiny_path, data, log)
        try:
            client = openai.OpenAI(base_url=second.url, api_key="unused", max_retries=0)
            batch = _ended(client, batch_id)
            output = _results(client, batch)
            assert second.stop() == 0
        finally:
            second.kill()
    assert batch.status == "completed" and batch.request_counts.completed == total
    assert sorted(int(r["custom_id"]) for r in output) == list(range(total))
    before, after = (_batch_executions(p) for p in logs)
    assert len(after) == total - len(done) and set(after.values()) == {"ok"}
    for r in output:  # lines recorded before the kill did not run again
        ran_in = before if int(r["custom_id"]) + 1 in done else after
        assert r["response"]["request_id"] in ran_in, r
    assert "Traceback" not in logs[1].read_text()


def _recorded_batches(store) -> list[str]:
    try:
        with sqlite3.connect(store) as db:
            return [r[0] for r in db.execute("SELECT batch_id FROM eval_batches")]
    except sqlite3.OperationalError:  # the runner has not made its tables yet
        return []


def test_eval_via_batch_resumes_after_sigkill_and_equals_the_live_route(server, tmp_path,
                                                                        capsys, monkeypatch):
    """lm-eval's 80 log-likelihood prompts (20 questions x 4 choices) as one batch of 10 lines; the
    runner killed once it recorded the batch; the re-run waits on that batch (none submitted
    again) and stores what the live route gives, question by question. Both paths run one
    request at a time here (num_concurrent 1, one batch line at a time), so the same prompts
    share each step: the log-likelihoods are bit-identical."""
    pytest.importorskip("lm_eval")
    shutil.copytree(ROOT / "configs" / "evals" / "tasks", tmp_path / "tasks")
    monkeypatch.setenv("EVAL_KEY", KEYS["acme"])
    version = (f'url = "{server.url}/v1"\nmodel = "tiny"\napi_key_env = "EVAL_KEY"\n'
               "batch_size = 8\nnum_concurrent = 1\n")
    suite = tmp_path / "suite.toml"
    suite.write_text(f'name = "via"\n[[tasks]]\npath = "tasks/capitals_mc.yaml"\n'
                     f'[[versions]]\nname = "batch"\nvia = "batch"\n{version}'
                     f'[[versions]]\nname = "live"\n{version}')
    client = _client(server)
    before = {b.id for b in client.batches.list(limit=100)}
    server.slow.set()  # the batch outlasts the runner killed below
    try:
        runner = subprocess.Popen([sys.executable, "-m", "jaxserve", "eval", "run", str(suite)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env=dict(os.environ, TQDM_DISABLE="1"))
        try:
            (batch_id,) = wait_for(lambda: _recorded_batches(tmp_path / "evals.sqlite")
                                   or runner.poll() is not None and ["exited"],
                                   "the runner to record its batch", 180)
        finally:
            runner.kill()
            _, err = runner.communicate()
        assert batch_id.startswith("batch_"), err.decode()[-2000:]
    finally:
        server.slow.clear()
    assert {b.id for b in client.batches.list(limit=100)} - before == {batch_id}

    assert main(["eval", "run", str(suite)]) == 0
    captured = capsys.readouterr()
    assert f"eval: resuming batch {batch_id}" in captured.err
    assert "submitted batch" not in captured.err
    assert {b.id for b in client.batches.list(limit=100)} - before == {batch_id}
    assert client.batches.retrieve(batch_id).request_counts.completed == 10
    (cmp,) = json.loads(captured.out.strip().splitlines()[-1])["comparisons"]
    assert cmp["paired"] == 20 and cmp["lost"] == [] and cmp["gained"] == []
    with open_store(tmp_path / "evals.sqlite") as store:
        batch, live = store.runs("via")
        assert (batch.settings["via"], live.settings["via"]) == ("batch", "live")
        assert batch.score == live.score
        assert store.samples(batch.id) == store.samples(live.id)  # log-likelihoods, bit for bit


# ---------------------------------------------------------------- the store alone


def test_store_counts_a_line_once_and_bounds_each_tenant(tmp_path):
    from jaxserve.errors import Conflict, NotFound, QuotaExceeded

    store = BatchStore(tmp_path)
    f = store.add_file("acme", "batch", "in.jsonl", b"x" * 10, max_tenant_bytes=16)
    with pytest.raises(QuotaExceeded):
        store.add_file("acme", "batch", "more.jsonl", b"x" * 7, max_tenant_bytes=16)
    with pytest.raises(NotFound):
        store.file_content("globex", f["id"])
    obj = {"id": "batch_1", "input_file_id": f["id"], "status": "in_progress", "usage": None,
           "request_counts": {"total": 2, "completed": 0, "failed": 0}}
    store.add_batch("acme", None, dict(obj), max_active=1)
    with pytest.raises(QuotaExceeded):
        store.add_batch("acme", None, {**obj, "id": "batch_2"}, max_active=1)
    with pytest.raises(NotFound):
        store.add_batch("globex", None, {**obj, "id": "batch_3"}, max_active=1)
    with pytest.raises(Conflict):  # the input of an unfinished batch
        store.delete_file("acme", f["id"])
    for _ in range(2):  # a line recorded twice (a retried commit) counts once
        store.record("batch_1", 1, True, {"custom_id": "a"}, (5, 2, 1, 0))
    got = store.batch("acme", "batch_1")
    assert got["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    assert (got["usage"]["input_tokens"], got["usage"]["output_tokens"]) == (5, 2)
    ended = store.finalize("batch_1", "expired", [{"custom_id": "b", "error": {}}])
    assert ended["status"] == "expired" and ended["expired_at"] is not None
    assert ended["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert store.finalize("batch_1", "completed", []) == ended  # ended once
    assert store.file_content("acme", ended["error_file_id"]).count(b"\n") == 1
    assert store.delete_file("acme", f["id"])["deleted"]
    store.close()

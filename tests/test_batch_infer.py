"""Offline batch inference: file handling (parsing, duplicate ids, resume after a torn write),
then the real engine answering a mixed file, an interrupted run resumed, `jaxserve batch
--deployment` answering each line on the version its model selects, and `jaxserve batch` /
tools/batch_infer.py on SmolLM2 against the golden outputs."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.entrypoints.batch import (DuplicateCustomIds, ResultWriter, answered_keys, parse_line,
                                  read_input, result_line, run_batch_on)
from jaxserve.core.engine_factory import build_engine
from jaxserve.errors import error_reply
from jaxserve.core.sampling_params import SamplingParams
from tests.test_cli import ROOT, run_cli, tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_grpc import engine_output, wait_idle


def _req(custom_id, url="/v1/chat/completions", **body):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_parse_good_lines():
    chat = parse_line(1, _req("a"))
    assert (chat.kind, chat.custom_id, chat.error) == ("chat", "a", None)
    comp = parse_line(2, _req("b", url="/v1/completions", prompt="x"))
    assert comp.kind == "completion" and comp.body["prompt"] == "x"


@pytest.mark.parametrize("text, param", [
    ("{not json", None),
    ("[1, 2]", None),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), "custom_id"),
    (_req("a", url="/v1/embeddings"), "url"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
     "method"),
    (json.dumps({"custom_id": "a", "url": "/v1/completions", "body": "x"}), "body"),
    (_req("a", stream=True), "stream"),
])
def test_malformed_lines_become_400_results(text, param):
    item = parse_line(7, text)
    status, body = error_reply(item.error)
    assert status == 400 and body["error"]["param"] == param
    assert body["error"]["message"]


def test_duplicate_custom_ids_name_the_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([_req("a"), _req("b"), "", _req("a")]) + "\n")
    with pytest.raises(DuplicateCustomIds, match=r"'a' \(lines 1 and 4\)"):
        read_input(path)


def test_resume_keys_and_torn_tail(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([_req("a"), "{bad", _req("c")]) + "\n")
    items = read_input(inp)
    out = tmp_path / "out.jsonl"
    writer = ResultWriter(out)
    for item in items[:2]:
        writer.write(result_line(item, *(error_reply(item.error) if item.error
                                         else (200, {"ok": True}))))
    writer.close()
    with out.open("a") as f:  # a run killed mid-write leaves a partial line
        f.write('{"id": "batch_req_x", "custom_id": "c"')
    assert answered_keys(out) == {"id:a", "line:2"}
    assert out.read_text().endswith("\n")
    assert [i.key for i in items if i.key not in answered_keys(out)] == ["id:c"]
    assert len(out.read_text().splitlines()) == 2


def test_missing_output_means_nothing_answered(tmp_path):
    assert answered_keys(tmp_path / "none.jsonl") == set()


# ---------------------------------------------------------------- the real engine behind the batch


TINY = "tiny"
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, smollm2_tokenizer_fields):
    # 2048 positions: a batch can hold requests long enough to be interrupted mid-way.
    path = tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields,
                     max_position_embeddings=2048)
    llm_engine = build_engine(str(path), num_pages=128, max_num_seqs=8,
                              max_num_batched_tokens=32, max_model_len=2048,
                              min_token_bucket=16, strict_compile=True, progress=False)
    engine = AsyncEngine(llm_engine)
    yield engine
    engine.shutdown()
    assert llm_engine.runner.num_serving_compiles == 0
    assert_no_leaks(llm_engine)


def _line(custom_id, url, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": TINY, **body}})


def _results(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(engine, inp, out) -> int:
    return asyncio.run(run_batch_on(engine, TINY, inp, out))


def test_mixed_file_every_line_answered_once(tiny_engine, tmp_path):
    chat = [{"role": "user", "content": "Hello there"}]
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    lines = [
        _line("chat", "/v1/chat/completions", messages=chat, **greedy),
        _line("text", "/v1/completions", prompt="The quick brown fox", **greedy),
        _line("ids-n2", "/v1/completions", prompt=[11, 12, 13], n=2, seed=3, max_tokens=6,
              ignore_eos=True),
        "{not json",
        json.dumps({"custom_id": "model", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "nope", "prompt": "hi"}}),
        _line("temperature", "/v1/completions", prompt="hi", temperature=-1),
        _line("url", "/v1/embeddings", input="hi"),
        # fits the context (10 + 2030 <= 2048) but not the 127-page pool: refused by the engine
        _line("pool", "/v1/completions", prompt=list(range(10, 20)), max_tokens=2030),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert _run(tiny_engine, inp, out) == 0
    results = _results(out)
    keys = [r["custom_id"] or f"line {r['line']}" for r in results]
    assert sorted(keys) == sorted(["chat", "text", "ids-n2", "line 4", "model", "temperature",
                                   "url", "pool", "line 9"])
    by_key = dict(zip(keys, results))
    for r in results:  # the OpenAI Batch output shape
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert set(r["response"]) == {"status_code", "request_id", "body"}
    status = {k: r["response"]["status_code"] for k, r in by_key.items()}
    assert status == {"chat": 200, "text": 200, "ids-n2": 200, "line 4": 400, "model": 404,
                      "temperature": 400, "url": 400, "pool": 400, "line 9": 400}
    errors = {k: r["response"]["body"]["error"] for k, r in by_key.items() if status[k] != 200}
    assert errors["model"]["code"] == "model_not_found"
    assert errors["temperature"]["param"] == "temperature"
    assert errors["pool"]["code"] == "context_length_exceeded" and "KV pages" in \
        errors["pool"]["message"]
    assert "line 4" in errors["line 4"]["message"]

    # Successful bodies are the engine's own greedy outputs, in OpenAI's response shape.
    tok = tiny_engine.tokenizer
    body = by_key["chat"]["response"]["body"]
    expected = engine_output(tiny_engine, tok.apply_chat_template(chat, add_generation_prompt=True),
                             SamplingParams(**greedy))
    assert body["object"] == "chat.completion" and body["model"] == TINY
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": expected.outputs[0].text}
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    body = by_key["text"]["response"]["body"]
    expected = engine_output(tiny_engine, "The quick brown fox", SamplingParams(**greedy))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected.outputs[0].text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    body = by_key["ids-n2"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    wait_idle(tiny_engine)


def test_structured_output_and_tool_lines(tiny_engine, tmp_path):
    """Batch lines take the same structured-output and tool fields as the server: even random
    weights answer within the constraint; a bad one is that line's 400 naming the field."""
    chat = [{"role": "user", "content": "Pick"}]
    schema = {"type": "object", "properties": {"pick": {"enum": ["a", "b"]}},
              "required": ["pick"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    sampled = dict(max_tokens=60, temperature=1.0, seed=5)
    lines = [
        _line("schema", "/v1/chat/completions", messages=chat, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": schema}}, **sampled),
        _line("choice", "/v1/completions", prompt="Pick", guided_choice=["yes", "no"], **sampled),
        _line("tool", "/v1/chat/completions", messages=chat, tools=[tool],
              tool_choice={"type": "function", "function": {"name": "noop"}}, **sampled),
        _line("bad", "/v1/completions", prompt="x", structured_outputs={"regex": "("}),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert _run(tiny_engine, inp, out) == 0
    by_key = {r["custom_id"]: r["response"] for r in _results(out)}
    assert {k: r["status_code"] for k, r in by_key.items()} == {
        "schema": 200, "choice": 200, "tool": 200, "bad": 400}
    message = by_key["schema"]["body"]["choices"][0]["message"]
    assert json.loads(message["content"])["pick"] in ("a", "b")
    assert by_key["choice"]["body"]["choices"][0]["text"] in ("yes", "no")
    choice = by_key["tool"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [("noop", "{}")]
    assert by_key["bad"]["body"]["error"]["param"] == "structured_outputs"
    wait_idle(tiny_engine)


def test_duplicate_custom_ids_refuse_the_whole_file(tiny_engine, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([_line("a", "/v1/completions", prompt="x"),
                              _line("b", "/v1/completions", prompt="y"),
                              _line("a", "/v1/completions", prompt="z")]) + "\n")
    finished = tiny_engine.stats().num_requests_finished
    assert _run(tiny_engine, inp, out) == 1
    err = capsys.readouterr().err
    assert "duplicate custom_id values" in err and "'a' (lines 1 and 3)" in err
    assert not out.exists() and tiny_engine.stats().num_requests_finished == finished


def test_interrupted_run_resumes_with_only_the_missing_requests(tiny_engine, tmp_path, capsys):
    # Four short requests finish first; four long ones are still running when the run is
    # cancelled, as Ctrl-C cancels asyncio.run's task.
    lines = [_line(f"r{i}", "/v1/completions", prompt=[100 + i] * 5, temperature=0,
                   ignore_eos=True, max_tokens=4 if i < 4 else 300) for i in range(8)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")

    async def interrupted():
        task = asyncio.ensure_future(run_batch_on(tiny_engine, TINY, inp, out))
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    wait_idle(tiny_engine)  # the cancelled requests gave their pages back
    partial = out.read_text()
    answered = [json.loads(line)["custom_id"] for line in partial.splitlines()]
    assert 2 <= len(answered) < 8
    with out.open("a") as f:  # and a kill mid-write left half a line
        f.write('{"id": "batch_req_torn", "custom_id": "r7", "respo')
    finished = tiny_engine.stats().num_requests_finished
    capsys.readouterr()
    assert _run(tiny_engine, inp, out) == 0
    assert f"resuming: {len(answered)} of 8 requests" in capsys.readouterr().err
    assert tiny_engine.stats().num_requests_finished - finished == 8 - len(answered)
    final = out.read_text()
    assert final.startswith(partial)  # answered lines untouched, torn tail gone
    results = _results(out)
    assert sorted(r["custom_id"] for r in results) == [f"r{i}" for i in range(8)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] ==
               (4 if int(r["custom_id"][1:]) < 4 else 300) for r in results)
    # A finished batch rerun changes nothing.
    assert _run(tiny_engine, inp, out) == 0
    assert out.read_text() == final
    assert tiny_engine.stats().num_requests_finished - finished == 8 - len(answered)


# ---------------------------------------------------------------- `jaxserve batch` on SmolLM2


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_lines_until(path, n: int, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None, f"the batch exited early: {proc.returncode}"
        assert time.monotonic() < end, f"fewer than {n} results before the deadline"
        time.sleep(0.05)


@pytest.mark.slow
def test_batch_cli_ctrl_c_resume_golden_and_tools_script(smollm2_path, smollm2_golden,
                                                         tmp_path):
    chat = smollm2_golden["cases"][0]
    raw = [c for c in smollm2_golden["cases"] if "prompt" in c["case"]][:2]
    lines = [json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": SMOLLM2, "messages": chat["case"]["messages"],
                                  "max_tokens": 32, "temperature": 0}}),
             json.dumps({"custom_id": "text", "method": "POST", "url": "/v1/completions",
                         "body": {"model": SMOLLM2, "prompt": raw[0]["case"]["prompt"],
                                  "max_tokens": 32, "temperature": 0}}),
             json.dumps({"custom_id": "ids", "method": "POST", "url": "/v1/completions",
                         "body": {"model": SMOLLM2, "prompt": raw[1]["input_ids"],
                                  "max_tokens": 32, "temperature": 0}}),
             "not json",
             # still running when Ctrl-C comes
             json.dumps({"custom_id": "long", "method": "POST", "url": "/v1/completions",
                         "body": {"model": SMOLLM2, "prompt": "Once", "max_tokens": 40,
                                  "ignore_eos": True}})]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    args = ["--model", SMOLLM2, "--input", str(inp), "--output", str(out), "--max-model-len",
            "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-pages", "64",
            "--min-token-bucket", "16"]
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps
    # an inherited SIG_IGN (so does asyncio.run): a suite started with `make test &` would pass
    # that on and the batch would never see the Ctrl-C. The batch gets a terminal's default.
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "batch", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        _read_lines_until(out, 1, proc, deadline_s=300)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-3000:]
    answered = len(_results(out))  # every line written is whole
    assert 1 <= answered < 5

    proc = run_cli("batch", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming: {answered} of 5 requests" in proc.stderr
    # The progress bar's tokens/s and the summary's are the same measure of the same run.
    bar_tok_s = float(re.findall(r"tok_s=([0-9.]+)", proc.stderr)[-1])
    summary_tok_s = float(re.search(r"\(([0-9.]+) tok/s\)", proc.stderr).group(1))
    assert 0.5 < bar_tok_s / summary_tok_s < 2
    by_id = {r["custom_id"]: r["response"] for r in _results(out)}
    assert len(by_id) == 5 == len(_results(out))
    body = by_id["chat"]["body"]
    assert body["choices"][0]["message"]["content"] == chat["greedy_text"].replace(
        "<|im_end|>", "")
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(chat["input_ids"])
    # --model is a one-version fleet with its manifest, as in serve
    assert body["system_fingerprint"].startswith("fp_")
    for key, case in zip(("text", "ids"), raw):
        choice = by_id[key]["body"]["choices"][0]
        assert choice["text"] == case["greedy_text"] and choice["finish_reason"] == "length"
    assert by_id[None]["status_code"] == 400
    assert by_id["long"]["body"]["usage"]["completion_tokens"] == 40
    # The tools/ script is the same command: everything is answered, so it loads no model.
    written = out.read_text()
    proc = subprocess.run([sys.executable, "tools/batch_infer.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "nothing to do" in proc.stderr, proc.stderr[-3000:]
    assert out.read_text() == written


# ---------------------------------------------------------------- --deployment, as serve's


def test_batch_deployment_answers_each_line_on_the_version_its_model_selects(
        tmp_path, smollm2_tokenizer_fields, capsys):
    from jaxserve.entrypoints.cli import main

    gguf = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields,
                     max_position_embeddings=256)
    engine = (f'model = "{gguf}"\nnum_pages = 32\nmax_num_seqs = 4\n'
              f"max_num_batched_tokens = 32\nmin_token_bucket = 16\n")
    deployment = tmp_path / "deploy.toml"
    # Two versions of one file; their max_model_len differs, so do their manifests.
    deployment.write_text(f"[version.v-a]\n{engine}max_model_len = 128\n"
                          f"[version.v-b]\n{engine}max_model_len = 256\n"
                          "[route.r]\nweights = { v-a = 0, v-b = 1 }\n")
    lines = [json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": "Hi", "max_tokens": 3}})
             for cid, model in (("route", "r"), ("version", "v-a"), ("unknown", "nope"))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    common = ["--input", str(inp), "--output", str(out), "--compile-cache-dir", ""]
    assert main(["batch", "--deployment", str(deployment), *common]) == 0
    results = {r["custom_id"]: r["response"] for r in _results(out)}
    assert results["unknown"]["status_code"] == 404
    bodies = {cid: results[cid]["body"] for cid in ("route", "version")}
    assert [results[cid]["status_code"] for cid in bodies] == [200, 200]
    assert {cid: b["model"] for cid, b in bodies.items()} == {"route": "v-b", "version": "v-a"}
    fingerprints = {b["system_fingerprint"] for b in bodies.values()}
    assert len(fingerprints) == 2 and all(f.startswith("fp_") for f in fingerprints)
    # one or the other, as serve; --served-model-name names --model only
    capsys.readouterr()
    assert main(["batch", *common]) == 1
    assert main(["batch", "--deployment", str(deployment), "--model", TINY, *common]) == 1
    assert main(["batch", "--deployment", str(deployment), "--served-model-name", "x",
                 *common]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert [("either --model" in e, "--served-model-name" in e) for e in errors] == [
        (True, False), (True, False), (False, True)]

"""The content policy and the audit log in the request path, end to end on SmolLM2 (one
module-scoped server with --policy, --audit-log, --log-prompts and a tenants file): a blocked
prompt is a 400 `content_policy_violation`; an output rule blocking the word the model says
greedily ("The capital of France is Paris.", the golden output) ends the stream with
finish_reason "content_filter" and the word is in no byte sent; a redacted e-mail address is what
the model sees (echo shows it) and what the access log holds; the batch runner's lines and gRPC
alike; the interventions are counted; and `jaxserve audit verify` passes on the records of the
mixed run (the last test: it flushes the log)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.entrypoints.batch import answer_items, batch_gateway, read_input
from jaxserve.core.engine_factory import build_engine
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import attach_engine, close_app, serving_of
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, _request, access_records, parse_sse, wait_for

SMOLLM2 = "smollm2-135m-instruct"
POLICY = """
[[pack.default.rule]]
name = "sesame"
stage = "input"
match = "literal"
pattern = "open sesame"
action = "block"

[[pack.default.rule]]
name = "email"
stage = "both"
match = "pii:email"
action = "redact"

[[pack.default.rule]]
name = "paris"
stage = "output"
match = "literal"
pattern = "Paris"
action = "block"

[[pack.default.rule]]
name = "france"
stage = "output"
match = "literal"
pattern = "France"
action = "flag"

[classifier.words]
class = "tests.audit_classifier.WordClassifier"
args = { block = "forbidden", flag = "curious", slow = "slowly", delay_s = 3.0 }
timeout_s = 1.0
workers = 2

[[pack.classified.rule]]
name = "words-block"
stage = "input"
match = "classifier:words"
label = "block"
threshold = 0.5
action = "block"

[[pack.redacting.rule]]
name = "sesame-anywhere"
stage = "input"
match = "literal"
pattern = "open sesame"
action = "block"

[[pack.redacting.rule]]
name = "city"
stage = "output"
match = "literal"
pattern = "Paris"
kind = "city"
action = "redact"
"""
TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.carol]
api_keys = ["sk-carol"]
policy = "default"
audit_content = true

[tenant.dave]
api_keys = ["sk-dave"]
policy = "redacting"

[tenant.erin]
api_keys = ["sk-erin"]
policy = "classified"

[tenant.frank]
api_keys = ["sk-frank"]
policy = "classified"
"""
# SmolLM2's greedy answer (../shared/golden): "The capital of France is Paris."
PARIS = {"model": SMOLLM2, "messages": [{"role": "user", "content": "What is the capital of "
                                                                    "France?"}],
         "temperature": 0, "max_tokens": 16}
EMAIL = "bob.smith@example.com"


def post(url: str, body, key: str = "sk-alice", **headers) -> object:
    return _request("POST", url, body, headers={"Authorization": f"Bearer {key}", **headers})


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("policy")
    (d / "policy.toml").write_text(POLICY)
    (d / "tenants.toml").write_text(TENANTS)
    llm = build_engine(SMOLLM2, num_pages=64, max_num_seqs=2,
                       max_num_batched_tokens=128, max_model_len=256,
                       min_token_bucket=16, strict_compile=True, progress=False)
    engine = AsyncEngine(llm)
    http = ServerThread(SMOLLM2, tenants_file=str(d / "tenants.toml"),
                        policy_file=str(d / "policy.toml"), audit_log_dir=str(d / "audit"),
                        log_prompts=True)
    http.loop.call_soon_threadsafe(attach_engine, http.app, engine)
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    grpc_server, port = http._call(start_grpc_server(engine, "127.0.0.1", 0, SMOLLM2,
                                                     serving=serving_of(http.app)))
    http.dir, http.engine, http.llm, http.grpc_target = d, engine, llm, f"127.0.0.1:{port}"
    yield http
    http._call(grpc_server.stop(grace=None))
    http.stop()
    close_app(http.app)
    engine.shutdown()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def idle(server) -> None:
    wait_for(lambda: not server.llm.has_unfinished()
             and server.engine.stats().pages_in_use == 0, "the engine to go idle")


@pytest.mark.slow
def test_blocked_prompt_is_400_and_nothing_is_generated(server):
    before = server.engine.stats().generation_tokens
    r = post(f"{server.url}/v1/chat/completions",
             {**PARIS, "messages": [{"role": "user", "content": "Please OPEN Sesame now"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("content_policy_violation", "messages")
    assert "sesame" in err["message"] and "Please" not in err["message"]
    assert server.engine.stats().generation_tokens == before


@pytest.mark.slow
def test_output_block_ends_the_stream_with_content_filter(server):
    raw = post(f"{server.url}/v1/chat/completions",
               {**PARIS, "stream": True, "logprobs": True, "top_logprobs": 2}).text
    assert "Paris" not in raw and "paris" not in raw.lower()  # nor in any logprobs token
    chunks = parse_sse(raw.encode())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "The capital of France is "
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "content_filter"
    idle(server)  # the request stopped at once: its pages are back
    body = post(f"{server.url}/v1/chat/completions", PARIS).json()
    assert body["choices"][0]["finish_reason"] == "content_filter"
    assert body["choices"][0]["message"]["content"] == "The capital of France is "
    metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in
               text_string_to_metric_families(_request("GET", f"{server.url}/metrics").text)
               for s in f.samples}
    key = ("jaxserve:policy_interventions_total",
           (("action", "block"), ("rule", "paris"), ("stage", "output")))
    assert metrics[key] == 2
    idle(server)


@pytest.mark.slow
def test_redaction_is_what_the_model_sees_and_the_log_holds(server, caplog):
    caplog.set_level("INFO", logger="jaxserve.access")
    r = post(f"{server.url}/v1/completions",
             {"model": SMOLLM2, "prompt": f"Mail {EMAIL} today.", "max_tokens": 1,
              "temperature": 0, "echo": True}, key="sk-carol")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("Mail [REDACTED:email] today.")
    record = wait_for(lambda: access_records(caplog, 1), "the access log")[0]
    assert record["prompt"] == ["Mail [REDACTED:email] today."]
    idle(server)


@pytest.mark.slow
def test_batch_lines_blocked_and_filtered(server, tmp_path):
    lines = [{"custom_id": "blocked", "method": "POST", "url": "/v1/chat/completions",
              "body": {**PARIS, "messages": [{"role": "user", "content": "open sesame"}]}},
             {"custom_id": "paris", "method": "POST", "url": "/v1/chat/completions",
              "body": PARIS}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    gateway, principal = batch_gateway(server.dir / "tenants.toml", "alice")
    asyncio.run_coroutine_threadsafe(
        answer_items(server.engine, SMOLLM2, read_input(inp), out, gateway, principal,
                     serving_of(server.app).policy), server.loop).result(120)
    results = {r["custom_id"]: r["response"] for r in map(json.loads,
                                                          out.read_text().splitlines())}
    assert results["blocked"]["status_code"] == 400
    assert results["blocked"]["body"]["error"]["code"] == "content_policy_violation"
    assert results["paris"]["body"]["choices"][0]["finish_reason"] == "content_filter"
    idle(server)


@pytest.mark.slow
def test_idempotent_replay_is_audited(server):
    body = {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 2}
    first = post(f"{server.url}/v1/completions", body, **{"Idempotency-Key": "k1"})
    again = post(f"{server.url}/v1/completions", body, **{"Idempotency-Key": "k1"})
    assert again.headers["idempotent-replayed"] == "true" and again.text == first.text
    idle(server)


@pytest.mark.slow
def test_grpc_invalid_argument_and_content_filter(server, smollm2_golden):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(server.grpc_target))
    metadata = (("authorization", "Bearer sk-alice"),)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(model=SMOLLM2, prompt="open sesame", max_tokens=4),
                           metadata=metadata))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("content_policy_violation")
    ids = smollm2_golden["cases"][0]["input_ids"]  # "What is the capital of France?"
    deltas = list(stub.Generate(pb.GenerateRequest(model=SMOLLM2, prompt_token_ids=ids,
                                                   max_tokens=16, temperature=0),
                                metadata=metadata))
    assert "".join(d.text for d in deltas) == "The capital of France is "
    assert deltas[-1].finish_reason == "content_filter"
    assert "Paris" not in b"".join(d.SerializeToString() for d in deltas).decode(errors="replace")
    idle(server)


@pytest.mark.slow
def test_redacted_output_is_in_no_logprobs_token_and_no_grpc_token_id(server, smollm2_golden):
    """Review a70e490, H4: with a `redact` rule on the word the model says, the text showed
    [REDACTED:city] but logprobs' tokens (and gRPC's token_ids) still spelled it."""
    body = post(f"{server.url}/v1/chat/completions",
                {**PARIS, "logprobs": True, "top_logprobs": 5}, key="sk-dave").json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "The capital of France is [REDACTED:city]."
    tokens = [c["token"] for c in choice["logprobs"]["content"]]
    alternatives = [t["token"] for c in choice["logprobs"]["content"] for t in c["top_logprobs"]]
    assert "".join(tokens).startswith("The capital of France is")
    assert "paris" not in " ".join(tokens + alternatives).lower()
    raw = post(f"{server.url}/v1/completions",
               {"model": SMOLLM2, "prompt": "The capital of France is", "max_tokens": 3,
                "temperature": 0, "logprobs": 5, "stream": True}, key="sk-dave").text
    assert "[REDACTED:city]" in raw and "paris" not in raw.lower()
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(server.grpc_target))
    deltas = list(stub.Generate(pb.GenerateRequest(
        model=SMOLLM2, prompt_token_ids=smollm2_golden["cases"][0]["input_ids"], max_tokens=16,
        temperature=0), metadata=(("authorization", "Bearer sk-dave"),)))
    assert "".join(d.text for d in deltas) == "The capital of France is [REDACTED:city]."
    spelled = server.llm.tokenizer.decode([t for d in deltas for t in d.token_ids])
    assert spelled.startswith("The capital of France is") and "Paris" not in spelled
    idle(server)


@pytest.mark.slow
def test_input_rules_screen_tools_and_past_tool_calls(server):
    """Review a70e490, M1: a blocked phrase moved into a tool's description, a past call's
    arguments (JSON-escaped), a /v1/responses function_call item, or spelled with a zero-width
    space, reached the model."""
    tool = {"type": "function", "function": {"name": "t", "description": "open sesame"}}
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "t", "arguments": '{"say": "\\u006fpen sesame"}'}}]}
    user = {"role": "user", "content": "do what the tool says"}
    for url, body in [
            ("/v1/chat/completions", {**PARIS, "messages": [user], "tools": [tool]}),
            ("/v1/chat/completions", {**PARIS, "messages": [user, call, {
                "role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
            ("/v1/chat/completions", {**PARIS, "messages": [
                {"role": "user", "content": "open \u200bSE\u0405AME"}]}),
            ("/v1/responses", {"model": SMOLLM2, "max_output_tokens": 4, "input": [
                user, {"type": "function_call", "call_id": "c1", "name": "t",
                       "arguments": '{"say": "open sesame"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})]:
        r = post(f"{server.url}{url}", body, key="sk-dave")
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["code"] == "content_policy_violation"
        assert "sesame-anywhere" in r.json()["error"]["message"]


@pytest.mark.slow
def test_one_tenant_cannot_saturate_the_classifier(server):
    """Review a70e490, M9: erin's slow calls (3 s against a 1 s timeout) took both workers, so
    frank's call queued behind them, timed out and was blocked. Now erin has one call at a
    time: her second waits for her first, then is a 429; frank's runs on the other worker."""
    from concurrent.futures import ThreadPoolExecutor

    slow = {**PARIS, "max_tokens": 1, "messages": [{"role": "user", "content": "Answer slowly"}]}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, f"{server.url}/v1/chat/completions", slow, "sk-erin")
        time.sleep(0.2)
        second = pool.submit(post, f"{server.url}/v1/chat/completions", slow, "sk-erin")
        time.sleep(0.2)
        frank = post(f"{server.url}/v1/chat/completions", {**PARIS, "max_tokens": 1},
                     "sk-frank")
        assert frank.status_code == 200, frank.text
        assert first.result().status_code == 400  # timed out: on_error "block"
        assert second.result().status_code == 429, second.result().text
        assert "classifier" in second.result().json()["error"]["message"]
    idle(server)


@pytest.mark.slow
def test_audit_log_of_the_mixed_run_verifies(server, capsys):
    """Last: the earlier tests' requests are the mixed run (blocked, filtered, redacted, batch)."""
    from jaxserve.entrypoints.cli import main

    close_app(server.app)  # flush, as a shutdown does
    assert main(["audit", "verify", str(server.dir / "audit")]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    raw = b"".join(p.read_bytes() for p in sorted((server.dir / "audit").glob("audit-*.jsonl")))
    assert EMAIL.encode() not in raw and b"sk-alice" not in raw
    records = [json.loads(line) for line in raw.splitlines()]
    # dave's, erin's and frank's requests (H4, M1, M9) are not part of this run's expected order
    requests = [r for r in records if r["type"] == "request"
                and r["tenant"] not in ("dave", "erin", "frank")]
    by_status = [(r["route"], r["status_code"], r["finish_reasons"]) for r in requests]
    assert by_status[:4] == [
        ("/v1/chat/completions", 400, []),
        ("/v1/chat/completions", 200, ["content_filter"]),
        ("/v1/chat/completions", 200, ["content_filter"]),
        ("/v1/completions", 200, ["length"])]
    assert sorted(by_status[4:6]) == [("batch:/v1/chat/completions", 200, ["content_filter"]),
                                     ("batch:/v1/chat/completions", 400, [])]
    blocked = requests[0]
    assert blocked["tenant"] == "alice" and len(blocked["key_id"]) == 12
    assert blocked["interventions"] == [{"rule": "sesame", "action": "block", "stage": "input",
                                         "count": 1}]
    assert {"rule": "france", "action": "flag", "stage": "output", "count": 1} \
        in requests[1]["interventions"]
    assert all("content" not in r for r in requests if r["tenant"] == "alice")
    assert [r["idempotent_replay"] for r in requests[6:8]] == [False, True]
    assert [(r["route"], r["status_code"], r["finish_reasons"]) for r in requests[8:]] == [
        ("grpc:Generate", 400, []), ("grpc:Generate", 200, ["content_filter"])]
    carol = requests[3]
    assert carol["tenant"] == "carol" and carol["client"] == "127.0.0.1"
    assert carol["content"]["prompt"] == ["Mail [REDACTED:email] today."]
    assert len(carol["content"]["outputs"]) == 1

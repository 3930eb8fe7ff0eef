"""The audit log on a running server (a tiny random model; one module-scoped HTTP + gRPC server
with a tenants file, --policy and --audit-log): every record names the model version that
answered (a fleet of two versions over one engine: which name answered is what is checked; a
route, a version by name, gRPC, the batch runner); every request to a generation route gets
exactly one record, those refused before they were parsed too (a body that is not JSON or too
deep), while a missing or wrong key's 401 is counted in its client's `refusals` summary, with the
wrong key's id and never the key; /v1/responses is
recorded under its own route; a keyed caller's request the router refuses (404, 405) gets one
record, an idempotent replay names the version of the answer it replays; every call beside
generation (embeddings, rerank, tokenize, detokenize, collections, gRPC Embed) gets one record
and is counted per tenant (gRPC Embed and ListModels as HTTP's calls); a
`jaxserve.safety.Classifier` named by dotted path in the policy
file flags, blocks, and blocks on its timeout (fail closed); with n > 1 a choice the output
filter ends has its engine sequence ended at once while its sibling goes on; and `jaxserve
audit verify` passes on the run's records (the last test: it flushes the log)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.entrypoints.batch import answer_items, batch_gateway, read_input
from jaxserve.core.engine import LLMEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.routing import Route
from jaxserve.gateway.keys import key_id
from jaxserve.gateway.tenants import hash_key
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.rag.config import EMBEDDING_MODEL, ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.entrypoints.http.app import attach_engine, close_app, serving_of
from tests.rag_helpers import tiny_embedder
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, _request, wait_for

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.bob]
api_keys = ["sk-bob"]
policy = "filtered"
"""
# A slow call sleeps 3 s against a 1 s timeout; two workers, so the call after it is not
# queued behind the sleeping one.
POLICY = """
[classifier.words]
class = "tests.audit_classifier.WordClassifier"
args = { block = "forbidden", flag = "curious", slow = "slowly", delay_s = 3.0 }
timeout_s = 1.0
on_error = "block"
workers = 2

[[pack.default.rule]]
name = "words-block"
stage = "input"
match = "classifier:words"
label = "block"
threshold = 0.5
action = "block"

[[pack.default.rule]]
name = "words-flag"
stage = "input"
match = "classifier:words"
label = "flag"
threshold = 0.5
action = "flag"
"""
ALICE = {"Authorization": "Bearer sk-alice"}
# Two seeded choices: the fixture runs it on the engine first and blocks (pack "filtered", bob's)
# a piece of choice 0's text that choice 1's lacks.
PROBE = {"prompt": list(range(300, 330)), "n": 2, "max_tokens": 24, "seed": 7,
         "temperature": 1.0, "ignore_eos": True}


def word_of_choice_0(llm: LLMEngine) -> str:
    """Three letters whose first occurrence is a third or more into the probe's choice 0 and
    which choice 1 lacks (seeded: the server's run draws the same tokens)."""
    llm.add_request("probe", {"prompt_token_ids": PROBE["prompt"]}, SamplingParams(
        n=2, max_tokens=24, seed=7, temperature=1.0, ignore_eos=True))
    while llm.has_unfinished():
        outs = [o for o in llm.step() if o.finished]
        final = outs[0] if outs else None
    first, second = (c.text.lower() for c in final.outputs)
    for k in range(len(first) // 3, len(first) - 3):
        word = first[k:k + 3]
        if word.isascii() and word.isalpha() and first.find(word) == k and word not in second:
            return word
    raise AssertionError(f"no word of {first!r} is missing from {second!r}")


def chat(model: str, content: str = "Hello") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("audit")
    (d / "tenants.toml").write_text(TENANTS)
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=256)
    llm = build_engine(str(path), num_pages=48, max_num_seqs=4,
                       max_num_batched_tokens=64, max_model_len=256,
                       min_token_bucket=16, strict_compile=True, progress=False)
    (d / "policy.toml").write_text(POLICY + f"""
[[pack.filtered.rule]]
name = "word"
stage = "output"
match = "literal"
pattern = "{word_of_choice_0(llm)}"
action = "block"
""")
    engine = AsyncEngine(llm)
    fleet = Fleet.of_engine("v-a", engine)
    fleet.adopt(VersionSpec("v-b", "tiny"), engine)
    fleet.set_route(Route("only-b", (("v-b", 1.0),)))
    # The retrieval routes (embeddings, rerank, collections, gRPC Embed), tiny random encoder.
    rag = RagService(RagConfig(d / "rag", EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)),
                     tiny_embedder())
    http = ServerThread("tiny", rag, tenants_file=str(d / "tenants.toml"),
                        policy_file=str(d / "policy.toml"), audit_log_dir=str(d / "audit"))
    http.loop.call_soon_threadsafe(lambda: attach_engine(http.app, None, fleet=fleet))
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    grpc_server, port = http._call(start_grpc_server(None, "127.0.0.1", 0, "unused", rag=rag,
                                                     serving=serving_of(http.app)))
    http.dir, http.engine, http.llm = d, engine, llm
    http.grpc_target = f"127.0.0.1:{port}"
    yield http
    http._call(grpc_server.stop(grace=None))
    http.stop()
    close_app(http.app)
    engine.shutdown()
    rag.close()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def post(server, path: str, body=None, content: bytes | None = None, headers=ALICE):
    return _request("POST", f"{server.url}{path}", body, content, headers=headers)


def all_records(server) -> list[dict]:
    """The request records written so far, once the writer has caught up."""
    audit = server.app[STATE_KEY].policy.audit
    wait_for(lambda: audit.pending == 0, "the audit writer")
    raw = b"".join(p.read_bytes() for p in sorted((server.dir / "audit").glob("audit-*.jsonl")))
    return [r for r in map(json.loads, raw.splitlines()) if r["type"] == "request"]


def stub(server):
    return pb_grpc.GenerationStub(grpc.insecure_channel(server.grpc_target))


def test_each_record_names_the_version_that_answered(server, tmp_path):
    before = len(all_records(server))
    assert post(server, "/v1/chat/completions", chat("v-a")).status_code == 200
    r = post(server, "/v1/completions", {"model": "only-b", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "v-b"
    assert post(server, "/v1/chat/completions", chat("v-c")).status_code == 404
    deltas = list(stub(server).Generate(pb.GenerateRequest(model="v-b", prompt="Hi",
                                                           max_tokens=2),
                                        metadata=(("authorization", "Bearer sk-alice"),)))
    assert deltas[-1].finish_reason
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "tiny", "prompt": "Hi", "max_tokens": 2}})
                   + "\n" + json.dumps({"custom_id": "b", "url": "/v1/completions", "body": 1})
                   + "\n")  # malformed: refused before the serving layer, recorded all the same
    gateway, principal = batch_gateway(server.dir / "tenants.toml", "alice")
    asyncio.run_coroutine_threadsafe(
        answer_items(server.engine, "tiny", read_input(inp), out, gateway, principal,
                     serving_of(server.app).policy), server.loop).result(120)
    records = all_records(server)[before:]
    assert [(r["route"], r["status_code"], r["model"], r["version"]) for r in records[:4]] == [
        ("/v1/chat/completions", 200, "v-a", "v-a"),
        ("/v1/completions", 200, "only-b", "v-b"),  # the route's version
        ("/v1/chat/completions", 404, "v-c", None),  # no version was chosen
        ("grpc:Generate", 200, "v-b", "v-b")]
    assert sorted((r["route"], r["status_code"], r["model"], r["version"])
                  for r in records[4:]) == [  # the batch runner's one version; its bad line
        ("batch:/v1/completions", 200, "tiny", "tiny"),
        ("batch:/v1/completions", 400, None, None)]
    assert {r["tenant"] for r in records} == {"alice"}


def test_requests_refused_before_parsing_get_one_record_each(server):
    before = len(all_records(server))
    assert post(server, "/v1/chat/completions", chat("v-a"), headers={}).status_code == 401
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert post(server, "/v1/completions", {"model": "v-a", "prompt": "x"},
                headers=wrong).status_code == 401
    assert post(server, "/v1/chat/completions", content=b'{"model": "v-a", ').status_code == 400
    deep = b"[" * 200 + b"]" * 200
    assert post(server, "/v1/completions", content=deep).status_code == 400
    assert post(server, "/v1/responses", {"model": "v-a", "input": "Hi"},
                headers={}).status_code == 401
    with pytest.raises(grpc.RpcError) as e:
        list(stub(server).Generate(pb.GenerateRequest(model="v-a", prompt="Hi")))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:  # its body is refused before the serving layer
        list(stub(server).Generate(pb.GenerateRequest(model="v-a", prompt="Hi",
                                                      prompt_token_ids=[1]),
                                   metadata=(("authorization", "Bearer sk-alice"),)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    records = all_records(server)[before:]
    alice = key_id(hash_key("sk-alice"))
    assert [(r["route"], r["status_code"], r["tenant"], r["key_id"], r["version"])
            for r in records] == [
        ("/v1/chat/completions", 400, "alice", alice, None),
        ("/v1/completions", 400, "alice", alice, None),
        ("grpc:Generate", 400, "alice", alice, None)]
    assert all(r["client"] for r in records)
    # the 401s: nobody's, so counted in their client's summary, not a record each (H6)
    server.app[STATE_KEY].policy.audit.write_summaries()
    all_records(server)
    raw = b"".join(p.read_bytes() for p in sorted((server.dir / "audit").glob("audit-*.jsonl")))
    summaries = {r["client"]: r for r in map(json.loads, raw.splitlines())
                 if r["type"] == "refusals"}
    http, grpc_client = summaries["127.0.0.1"], next(c for c in summaries if "127.0.0.1:" in c)
    assert (http["statuses"], http["routes"], http["key_ids"]) == (
        {"401_invalid_api_key": 3},
        {"/v1/chat/completions": 1, "/v1/completions": 1, "/v1/responses": 1},
        [key_id(hash_key("sk-wrong"))])
    assert summaries[grpc_client]["routes"] == {"grpc:Generate": 1}


def test_responses_are_recorded_under_their_own_route(server):
    before = len(all_records(server))
    r = post(server, "/v1/responses", {"model": "v-b", "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    [record] = all_records(server)[before:]
    assert (record["route"], record["status_code"], record["version"]) == (
        "/v1/responses", 200, "v-b")


def test_a_classifier_from_the_policy_file_flags_blocks_and_fails_closed(server):
    before = len(all_records(server))
    flagged = post(server, "/v1/chat/completions", chat("v-a", "I am curious"))
    assert flagged.status_code == 200, flagged.text
    blocked = post(server, "/v1/chat/completions", chat("v-a", "Something FORBIDDEN"))
    assert blocked.status_code == 400
    assert blocked.json()["error"]["code"] == "content_policy_violation"
    assert "words-block" in blocked.json()["error"]["message"]
    slow = post(server, "/v1/chat/completions", chat("v-a", "Answer slowly"))
    assert slow.status_code == 400  # timed out: on_error "block"
    assert "classifier:words" in slow.json()["error"]["message"]
    records = all_records(server)[before:]
    assert [(r["status_code"], r["interventions"]) for r in records] == [
        (200, [{"rule": "words-flag", "action": "flag", "stage": "input", "count": 1}]),
        (400, [{"rule": "words-block", "action": "block", "stage": "input", "count": 1}]),
        (400, [{"rule": "classifier:words", "action": "block", "stage": "input",
                "count": 1}])]


def test_a_choice_the_filter_ends_frees_its_sequence_while_its_sibling_goes_on(server,
                                                                             monkeypatch):
    ended = []
    abort_sequence = server.engine.abort_sequence

    async def spy(request_id, index):
        ended.append(index)
        await abort_sequence(request_id, index)
    monkeypatch.setattr(server.engine, "abort_sequence", spy)
    r = post(server, "/v1/completions", {"model": "v-a", **PROBE},
             headers={"Authorization": "Bearer sk-bob"})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["content_filter", "length"]
    assert ended == [0]  # choice 0's sequence alone, while choice 1 still ran
    wait_for(lambda: not server.llm.has_unfinished()
             and server.engine.stats().pages_in_use == 0, "the engine to go idle")
    assert_no_leaks(server.llm)


def test_the_routers_404_and_405_get_one_record_each_for_a_known_key(server):
    before = len(all_records(server))
    missing = post(server, "/v1/chat/completion", chat("v-a"))  # a typo of the route
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": "Invalid URL (POST /v1/chat/completion)",
                                       "type": "invalid_request_error", "param": None,
                                       "code": "not_found"}
    wrong = _request("GET", f"{server.url}/v1/completions", headers=ALICE)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    # not recorded: no key accepted (401 before the router is asked), and the routes open to
    # anyone (anyone could grow the log with them)
    assert post(server, "/v1/nope", {}, headers={"Authorization": "Bearer sk-x"}).status_code \
        == 401
    assert post(server, "/health", {}, headers={}).status_code == 405
    assert post(server, "/admin/nope", {}, headers={}).status_code == 404
    records = all_records(server)[before:]
    alice = key_id(hash_key("sk-alice"))
    assert [(r["route"], r["status_code"], r["status"], r["tenant"], r["key_id"], r["model"])
            for r in records] == [
        ("/v1/chat/completion", 404, "404_not_found", "alice", alice, None),
        ("/v1/completions", 405, "405_method_not_allowed", "alice", alice, None)]


def test_every_call_beside_generation_gets_one_record_and_is_counted(server):
    """Embeddings, rerank, tokenize, detokenize, the collection routes and gRPC Embed: one
    record each (a 4xx too; a 401 is in its client's `refusals` summary), with the tokens the
    encoder read; /v1/models and gRPC ListModels are counted but not recorded (clients poll
    them)."""
    before = len(all_records(server))
    bob = {"Authorization": "Bearer sk-bob"}
    calls = [
        ("POST", "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": ["Paris", "a b"]}, ALICE),
        ("POST", "/v1/rerank", {"query": "capital", "documents": ["Paris", "bread"]}, ALICE),
        ("POST", "/tokenize", {"model": "v-a", "prompt": "Hello"}, bob),
        ("POST", "/detokenize", {"model": "v-a", "tokens": [1, 2]}, ALICE),
        ("POST", "/detokenize", {"model": "v-a", "tokens": [-1]}, ALICE),  # 400
        ("POST", "/v1/collections", {"name": "kb"}, ALICE),
        ("GET", "/v1/collections", None, ALICE),
        ("POST", "/v1/collections/kb/documents", {"documents": [{"id": "d", "text": "Paris"}]},
         ALICE),
        ("POST", "/v1/collections/kb/search", {"query": "Paris", "mode": "bm25"}, ALICE),
        ("POST", "/v1/collections/nope/search", {"query": "Paris"}, ALICE),  # 404
        ("DELETE", "/v1/collections/kb/documents/d", None, ALICE),
        ("DELETE", "/v1/collections/kb", None, ALICE),
        ("POST", "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "x"}, {}),  # 401
        ("GET", "/v1/models", None, ALICE),  # not recorded
    ]
    statuses = [_request(m, f"{server.url}{path}", body, headers=h).status_code
                for m, path, body, h in calls]
    assert statuses == [200, 200, 200, 200, 400, 201, 200, 200, 200, 404, 200, 200, 401, 200]
    metadata = (("authorization", "Bearer sk-alice"),)
    counted = requests_by_outcome(server, "alice")
    reply = stub(server).Embed(pb.EmbedRequest(model=EMBEDDING_MODEL, input=["a"]),
                               metadata=metadata)
    assert len(reply.embeddings) == 1
    with pytest.raises(grpc.RpcError) as e:
        stub(server).Embed(pb.EmbedRequest(model="nope", input=["a"]), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert {m.id for m in stub(server).ListModels(pb.ListModelsRequest(),
                                                  metadata=metadata).models} >= {"v-a"}
    records = all_records(server)[before:]
    alice, bob_id = key_id(hash_key("sk-alice")), key_id(hash_key("sk-bob"))
    expected = [(path, status, "alice" if h is ALICE else "bob" if h is bob else None,
                 alice if h is ALICE else bob_id if h is bob else None)
                for (_, path, _, h), status in zip(calls[:-1], statuses) if status != 401]
    expected += [("grpc:Embed", 200, "alice", alice), ("grpc:Embed", 404, "alice", alice)]
    assert [(r["route"], r["status_code"], r["tenant"], r["key_id"]) for r in records] \
        == expected
    assert [r["status"] for r in records if r["status_code"] >= 400] == [
        "400_invalid_request_error", "404_not_found", "404_model_not_found"]
    tokens = {(r["route"], r["prompt_tokens"]) for r in records if r["prompt_tokens"]}
    assert {route for route, _ in tokens} == {"/v1/embeddings", "/v1/rerank", "grpc:Embed",
                                              "/v1/collections/kb/documents"}  # upserts pay (M7)
    assert all(r["completion_tokens"] == 0 and r["version"] is None and "content" not in r
               and r["request_id"] for r in records)
    assert len({r["request_id"] for r in records}) == len(records)
    # counted per tenant by outcome as HTTP's calls are: gRPC Embed and ListModels too
    now = requests_by_outcome(server, "alice")
    assert {k: now[k] - counted.get(k, 0) for k in now if now[k] != counted.get(k, 0)} == {
        "ok": 2, "404_model_not_found": 1}


def requests_by_outcome(server, tenant: str) -> dict[str, float]:
    """jaxserve:requests_total of `tenant` by outcome, summed over versions and routes."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(_request("GET", f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == "jaxserve:requests_total" and s.labels["tenant"] == tenant:
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0) + s.value
    return counts


def test_an_idempotent_replay_records_the_version_that_answered(server):
    before = len(all_records(server))
    key = {**ALICE, "Idempotency-Key": "replay-1"}
    first = post(server, "/v1/chat/completions", chat("only-b"), headers=key)
    again = post(server, "/v1/chat/completions", chat("only-b"), headers=key)
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    records = all_records(server)[before:]
    assert [(r["model"], r["version"], r["idempotent_replay"]) for r in records] == [
        ("only-b", "v-b", False), ("only-b", "v-b", True)]


def test_audit_log_of_the_run_verifies(server, capsys):
    """Last: the earlier tests' requests are the run."""
    from jaxserve.entrypoints.cli import main

    count = len(all_records(server))
    close_app(server.app)  # flush, as a shutdown does
    assert main(["audit", "verify", str(server.dir / "audit")]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    raw = b"".join(p.read_bytes() for p in (server.dir / "audit").glob("audit-*.jsonl"))
    assert b"sk-wrong" not in raw and b"sk-alice" not in raw
    assert count == 6 + 3 + 1 + 3 + 1 + 2 + 14 + 2  # the 401s: in refusals summaries

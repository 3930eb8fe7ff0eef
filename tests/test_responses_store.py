"""Stored, chained and background responses against a real server (a tiny random model with
SmolLM2's tokenizer and chat template; retrieval with the tiny random encoder) with the official
`openai` client: store + retrieve + input_items, previous_response_id chains (the prompt the
engine got is the whole conversation: its token count equals /tokenize's of the same messages)
and branching, tenant isolation (404), DELETE removing the content from the database file,
store false, Idempotency-Key, background + cancel (the engine request aborted, its pages back),
a background stream read in part and resumed with starting_after, and a file_search run whose
steps are logged and audited."""

from __future__ import annotations

import json
import sqlite3

import openai
import pytest

from jaxserve.agents.file_search import citations
from jaxserve.agents.store import FILE_NAME
from jaxserve.audit import verify
from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from tests.rag_helpers import tiny_embedder
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, _request, slowable, wait_for

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.bob]
api_keys = ["sk-bob"]
"""
MARKER = "zebra-marker-8c1f"


class Server:
    def __init__(self, http: ServerThread, engine: AsyncEngine, llm, data_dir, audit_dir):
        self.http, self.engine, self.llm = http, engine, llm
        self.url, self.data_dir, self.audit_dir = http.url, data_dir, audit_dir
        self.slow = slowable(llm, 0.05)  # set: each engine step takes 50 ms longer

    def client(self, key: str = "sk-alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.data_dir / FILE_NAME)


def tiny_chat_engine(directory, tokenizer_fields):
    """The agent tests' engine: a tiny random model with SmolLM2's tokenizer and chat template,
    strict compile (tests/test_agent_server.py uses it too)."""
    return build_engine(str(tiny_gguf(directory / "tiny.gguf", tokenizer_fields,
                                      max_position_embeddings=1024)),
                        num_pages=80, max_num_seqs=4, max_num_batched_tokens=32,
                        max_model_len=1024, min_token_bucket=16, strict_compile=True,
                        progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("responses")
    tenants = d / "tenants.toml"
    tenants.write_text(TENANTS)
    llm = tiny_chat_engine(d, smollm2_tokenizer_fields)
    engine = AsyncEngine(llm)
    rag = RagService(RagConfig(d / "rag", EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)), tiny_embedder())
    http = ServerThread("tiny", rag, tenants_file=str(tenants), data_dir=str(d / "data"),
                        audit_log_dir=str(d / "audit"))
    srv = Server(http, engine, llm, d / "data", d / "audit")
    http.attach(engine)
    yield srv
    http.stop()
    engine.shutdown()
    rag.close()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def _tokens(server: Server, messages: list[dict]) -> int:
    r = _request("POST", f"{server.url}/tokenize", {"model": "tiny", "messages": messages},
                 headers={"Authorization": "Bearer sk-alice"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _text(response) -> str:
    return "".join(p.text for item in response.output if item.type == "message"
                   for p in item.content)


def test_store_retrieve_chain_branch_isolation_and_delete(server):
    alice, bob = server.client(), server.client("sk-bob")
    first = alice.responses.create(model="tiny", input=f"Hello {MARKER}", max_output_tokens=6,
                                   temperature=0)
    assert first.store is True and first.status in ("completed", "incomplete")
    assert alice.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = alice.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", f"Hello {MARKER}")]

    # The chain's turns are in the prompt the engine got: its length is the chat template's
    # of the whole conversation.
    second = alice.responses.create(model="tiny", input="And then?", max_output_tokens=6,
                                    temperature=0, previous_response_id=first.id)
    said = [{"role": "user", "content": f"Hello {MARKER}"},
            {"role": "assistant", "content": _text(first)}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _tokens(server, said + [
        {"role": "user", "content": "And then?"}])
    # Branching from the first response (a rollback of the second) sees only the first.
    branch = alice.responses.create(model="tiny", input="Instead?", max_output_tokens=6,
                                    temperature=0, previous_response_id=first.id)
    assert branch.usage.input_tokens == _tokens(server, said + [
        {"role": "user", "content": "Instead?"}])

    # Another tenant: the response does not exist.
    for call in (lambda: bob.responses.retrieve(first.id),
                 lambda: bob.responses.delete(first.id),
                 lambda: bob.responses.input_items.list(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(model="tiny", input="x", max_output_tokens=2,
                             previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"

    # Deleted: gone, and its text is nowhere in the database's files.
    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)
    for path in server.data_dir.iterdir():
        assert MARKER.encode() not in path.read_bytes(), path
    with pytest.raises(openai.BadRequestError):  # the chain through it is broken
        alice.responses.create(model="tiny", input="x", max_output_tokens=2,
                               previous_response_id=second.id)

    unstored = alice.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def test_idempotency_key_replays_a_stored_response(server):
    body = {"model": "tiny", "input": "Once.", "max_output_tokens": 3}
    headers = {"Authorization": "Bearer sk-alice", "Idempotency-Key": "responses-1"}
    one = _request("POST", f"{server.url}/v1/responses", body, headers=headers)
    two = _request("POST", f"{server.url}/v1/responses", body, headers=headers)
    assert one.status_code == two.status_code == 200
    assert two.headers.get("idempotent-replayed") == "true"
    assert one.json()["id"] == two.json()["id"]


def test_background_cancel_aborts_the_engine_request(server):
    alice = server.client()
    server.slow.set()
    try:
        r = alice.responses.create(model="tiny", input="Count.", max_output_tokens=400,
                                   background=True, temperature=0)
        assert (r.status, r.background) == ("queued", True)
        wait_for(lambda: server.engine.stats().num_running == 1, "the run's model turn")
        assert alice.responses.retrieve(r.id).status == "in_progress"
        cancelled = alice.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
        # Aborted, its pages freed: nothing runs, every page is free again.
        wait_for(lambda: server.engine.stats().num_running == 0, "the abort", 2.0)
    finally:
        server.slow.clear()
    assert alice.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # not a background response
        alice.responses.cancel(alice.responses.create(model="tiny", input="x",
                                                      max_output_tokens=2).id)


def test_background_stream_resumes_after_a_sequence_number(server):
    alice = server.client()
    server.slow.set()
    try:
        stream = alice.responses.create(model="tiny", input="Tell me.", max_output_tokens=24,
                                        background=True, stream=True, temperature=0)
        head = []
        for event in stream:
            head.append(event)
            if len(head) == 5:
                break
        stream.close()
        rid = head[0].response.id
        assert [e.sequence_number for e in head] == list(range(5))
        assert [e.type for e in head[:3]] == ["response.created", "response.queued",
                                              "response.in_progress"]
        rest = list(alice.responses.retrieve(rid, stream=True, starting_after=2))
    finally:
        server.slow.clear()
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    assert [e.model_dump() for e in rest[:2]] == [e.model_dump() for e in head[3:]]
    final = rest[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.model_dump() == alice.responses.retrieve(rid).model_dump()
    # Replayed from the start once it has ended.
    again = list(alice.responses.retrieve(rid, stream=True, starting_after=-1))
    assert [e.sequence_number for e in again] == list(range(len(again)))
    assert again[-1].model_dump() == final.model_dump()


def test_file_search_run_is_logged_step_by_step_and_audited(server):
    headers = {"Authorization": "Bearer sk-alice"}
    r = _request("POST", f"{server.url}/v1/collections", {"name": "notes"}, headers=headers)
    assert r.status_code == 201, r.text
    r = _request("POST", f"{server.url}/v1/collections/notes/documents", {"documents": [
        {"id": "cats", "text": "Cats sleep most of the day.", "metadata": {"filename": "c.txt"}},
        {"id": "dogs", "text": "Dogs like long walks."}]}, headers=headers)
    assert r.status_code == 200, r.text
    alice = server.client()
    tools = [{"type": "file_search", "vector_store_ids": ["notes"], "max_num_results": 2}]
    resp = alice.responses.create(model="tiny", input="What do cats do?", tools=tools,
                                  tool_choice="required", max_tool_calls=2,
                                  max_output_tokens=128, temperature=0)
    kinds = [item.type for item in resp.output]
    assert kinds.count("file_search_call") == 2 and kinds[-1] == "message", kinds
    calls = [item for item in resp.output if item.type == "file_search_call"]
    assert all(c.status == "completed" and c.results for c in calls), calls
    assert {x.file_id for c in calls for x in c.results} <= {"cats", "dogs"}
    # The step log: turn, call, turn, call, turn; each written once and completed.
    with server.db() as db:
        steps = db.execute("SELECT step_id, kind, tool, status, attempts FROM steps WHERE "
                           "response_id=? ORDER BY position", (resp.id,)).fetchall()
    assert [(k, t, s, a) for _, k, t, s, a in steps] == [
        ("model_turn", None, "completed", 1), ("tool_call", "file_search", "completed", 1)] * 2 \
        + [("model_turn", None, "completed", 1)]
    # Each step is on the audit log's chain, started and ended, with tenant and response id.
    wait_for(lambda: len(_step_records(server, resp.id)) == 2 * len(steps), "the audit records")
    records = _step_records(server, resp.id)
    assert {(r["step_id"], r["status"]) for r in records} == {
        (s[0], status) for s in steps for status in ("started", "completed")}
    assert all(r["tenant"] == "alice" for r in records)
    assert verify(server.audit_dir).ok
    # Another tenant's collection is not searched: the model reads the error as the result.
    # Greedy, as above: sampled, the random model's call could run past max_output_tokens.
    bob = server.client("sk-bob")
    other = bob.responses.create(model="tiny", input="Cats?", tools=tools,
                                 tool_choice="required", max_tool_calls=1,
                                 max_output_tokens=128, temperature=0)
    assert [i.status for i in other.output if i.type == "file_search_call"] == ["failed"]
    # An answer that names a file the search returned cites it (OpenAI's file_citation), where
    # it names it: here a follow-up turn whose format makes the random model name one.
    cited = calls[0].results[0]
    schema = {"type": "object", "properties": {"source": {"enum": [cited.filename]}},
              "required": ["source"], "additionalProperties": False}
    events = list(alice.responses.create(
        model="tiny", previous_response_id=resp.id, input="Which file?", max_output_tokens=64,
        temperature=0, stream=True,
        text={"format": {"type": "json_schema", "name": "source", "schema": schema}}))
    final = events[-1].response
    (part,) = final.output[-1].content
    end = part.text.index(cited.filename) + len(cited.filename)
    assert [a.model_dump() for a in part.annotations] == [{
        "type": "file_citation", "file_id": cited.file_id, "filename": cited.filename,
        "index": end}], part
    (added,) = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert added.annotation_index == 0
    assert added.annotation.model_dump() == part.annotations[0].model_dump()


@pytest.mark.parametrize("text, index", [
    ("see c.txt.", [9]), ("c.txt and c.txt", [5, 15]), ("abc.txt, c.txtx", []),
    ("by cats", [7]),  # a file is named by its id too
])
def test_a_citation_is_where_the_answer_names_the_file(text, index):
    assert [a["index"] for a in citations(text, {"cats": "c.txt"})] == index


def _step_records(server: Server, response_id: str) -> list[dict]:
    records = []
    for path in sorted(server.audit_dir.glob("audit-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("type") == "step" and record["response_id"] == response_id:
                records.append(record)
    return records

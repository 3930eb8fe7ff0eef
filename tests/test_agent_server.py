"""Agent features of /v1/responses on one real server (so one engine warmup): remote MCP tools,
the per-tenant tool allowlist and conversations.

Conversations (/v1/conversations with the `openai` client): created with items, named by
responses (their prompt is the whole conversation; their input and output join it), items added,
read, deleted and paged, metadata replaced, another tenant's a 404, deletion removing the content
from the database file.

Remote MCP tools, against a real MCP server built with the official SDK
(tests/mcp_server.py, streamable HTTP on loopback) and a real jaxserve server (a tiny random model
with SmolLM2's tokenizer and chat template; the model's call forced by tool_choice), with the
`openai` client: the server's tools listed (`mcp_list_tools`), a call made (`mcp_call`, its
output the MCP server's answer to the arguments the model wrote) and logged as steps, the stream's
MCP events, approval requests answered by a following request (approved: the call is made; denied:
not), the bounds (hosts not allowed, duplicate labels, unknown approvals: 400 naming the field; a
tenant's tool allowlist: 403), failures as the model reads them; code_interpreter's forced call run
in the real sandbox (bubblewrap) with the tenant's own code length bound; and, host side with scripted
model turns, an MCP call interrupted by a shutdown re-issued with the same step id on resume."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sqlite3
import subprocess
import sys
from typing import Annotated

import openai
import pytest
from pydantic import Field

from jaxserve.agents.mcp_tools import McpLimits, McpTools
from jaxserve.agents.run import SHUTDOWN, Run, TurnResult
from jaxserve.agents.store import FILE_NAME, ResponseStore, StoreConfig
from jaxserve.agents.tools import ToolContext, ToolError
from jaxserve.core.async_engine import AsyncEngine
from tests.test_cli import ROOT
from tests.test_engine import assert_no_leaks
from tests.test_responses_store import tiny_chat_engine
from tests.test_server import ServerThread, _request, wait_for

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice-mcp-tools-0000000"]

[tenant.alice.code_interpreter]
code_chars = 40

[tenant.bob]
api_keys = ["sk-bob-mcp-tools-000000000"]
tools = ["file_search"]
"""
ALICE, BOB = "sk-alice-mcp-tools-0000000", "sk-bob-mcp-tools-000000000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class McpServer:
    def __init__(self, directory):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = directory / "calls.jsonl"
        self.log.touch()
        self.stderr = (directory / "mcp_server.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.mcp_server", str(self.port), str(self.log)],
            cwd=ROOT, stdout=self.stderr, stderr=subprocess.STDOUT)

        def listening():
            assert self.process.poll() is None, "the MCP server exited"
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(listening, "the MCP server")

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self.stderr.close()


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory):
    server = McpServer(tmp_path_factory.mktemp("mcp"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields, mcp_server):
    d = tmp_path_factory.mktemp("mcp_responses")
    tenants = d / "tenants.toml"
    tenants.write_text(TENANTS)
    llm = tiny_chat_engine(d, smollm2_tokenizer_fields)
    engine = AsyncEngine(llm)
    http = ServerThread("tiny", tenants_file=str(tenants), data_dir=str(d / "data"),
                        mcp_allowed_hosts=("127.0.0.1",), code_interpreter=True)
    http.data_dir = d / "data"
    http.attach(engine)
    yield http
    http.stop()
    engine.shutdown()
    assert llm.runner.num_serving_compiles == 0
    assert_no_leaks(llm)


def _client(server, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _tool(mcp_server, **fields) -> dict:
    return {"type": "mcp", "server_label": "calc", "server_url": mcp_server.url, **fields}


def _steps(server, rid: str) -> list[tuple]:
    with sqlite3.connect(server.data_dir / FILE_NAME) as db:
        return db.execute("SELECT kind, tool, status, attempts FROM steps WHERE response_id=? "
                          "ORDER BY position", (rid,)).fetchall()


def test_a_forced_call_is_listed_made_streamed_and_logged(server, mcp_server):
    alice = _client(server)
    tools = [_tool(mcp_server, allowed_tools=["shout"], require_approval="never",
                   headers={"X-Token": "secret-token-1"})]
    events = list(alice.responses.create(
        model="tiny", input="Shout a word.", tools=tools, max_tool_calls=1,
        tool_choice={"type": "mcp", "server_label": "calc", "name": "shout"},
        max_output_tokens=128, temperature=0, stream=True))
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # (the last turn, offered no tool, may be cut by max_output_tokens: incomplete)
    assert [item.type for item in final.output] == ["mcp_list_tools", "mcp_call", "message"], \
        final.model_dump()
    listing, call = final.output[0], final.output[1]
    assert [t.name for t in listing.tools] == ["shout"] and listing.error is None
    # The answer is the MCP server's to the arguments the model wrote (under the schema).
    arguments = json.loads(call.arguments)
    assert (call.status, call.name, call.server_label) == ("completed", "shout", "calc")
    assert call.output == arguments["text"].upper() + "!"
    kinds = [e.type for e in events]
    for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                 "response.mcp_call.in_progress", "response.mcp_call.completed"):
        assert kinds.count(kind) == 1, (kind, kinds)
    # One call reached the server, with the step's id as its key and the request's header.
    (made,) = [c for c in mcp_server.calls() if c["step_id"].startswith(final.id)]
    assert made == {"tool": "shout", "arguments": arguments, "step_id": f"{final.id}.step002",
                    "token": "secret-token-1", "authorization": None}
    assert _steps(server, final.id) == [
        ("list_tools", "mcp", "completed", 1), ("model_turn", None, "completed", 1),
        ("tool_call", "mcp", "completed", 1), ("model_turn", None, "completed", 1)]
    # The header is neither echoed nor kept (a response not run in the background).
    assert "headers" not in final.tools[0].model_dump(exclude_none=True)
    with sqlite3.connect(server.data_dir / FILE_NAME) as db:
        (settings,), = db.execute("SELECT settings FROM responses WHERE id=?", (final.id,))
    assert "secret-token-1" not in settings


def test_approval_requests_are_answered_by_the_next_request(server, mcp_server):
    alice = _client(server)
    tools = [_tool(mcp_server, allowed_tools=["shout"])]  # require_approval: "always" by default
    first = alice.responses.create(
        model="tiny", input="Shout a word.", tools=tools, max_tool_calls=1,
        tool_choice={"type": "mcp", "server_label": "calc", "name": "shout"},
        max_output_tokens=128, temperature=0)
    assert first.status == "completed"
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_approval_request"]
    request = first.output[1]
    assert not [c for c in mcp_server.calls() if c["step_id"].startswith(first.id)]

    approved = alice.responses.create(
        model="tiny", previous_response_id=first.id, tools=tools, max_tool_calls=1,
        max_output_tokens=16, input=[{"type": "mcp_approval_response",
                                      "approval_request_id": request.id, "approve": True}])
    call = approved.output[0]
    assert (call.type, call.status, call.approval_request_id) == ("mcp_call", "completed",
                                                                  request.id)
    arguments = json.loads(request.arguments)
    assert call.output == arguments["text"].upper() + "!"
    assert "mcp_list_tools" not in [item.type for item in approved.output]  # listed before
    assert [c["arguments"] for c in mcp_server.calls()
            if c["step_id"].startswith(approved.id)] == [arguments]

    # A branch from the same response that denies it: no call.
    denied = alice.responses.create(
        model="tiny", previous_response_id=first.id, tools=tools, max_output_tokens=16,
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                "approve": False, "reason": "not now"}], tool_choice="none")
    assert "mcp_call" not in [item.type for item in denied.output]
    assert not [c for c in mcp_server.calls() if c["step_id"].startswith(denied.id)]


@pytest.mark.parametrize("body, status, param", [
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://example.com/mcp"}]},
     400, "tools[0].server_url"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://u:p@127.0.0.1/m"}]},
     400, "tools[0].server_url"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "ftp://127.0.0.1/mcp"}]},
     400, "tools[0].server_url"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1/mcp"},
                {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1/mcp"}]},
     400, "tools[1].server_label"),
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_nope",
                 "approve": True}]}, 400, "input[0].approval_request_id"),
    # an approval answers a request before it, not one after it
    ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_1",
                 "approve": True},
                {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "x",
                 "name": "shout", "arguments": "{}"}]}, 400, "input[0].approval_request_id"),
    # MCP items sent back as input are checked as OpenAI's shapes (the message names the field)
    ({"input": [{"type": "mcp_call", "server_label": "x", "name": "shout", "arguments": "{}"}]},
     400, "input"),
    ({"input": [{"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "x", "tools": [
        {"name": "shout", "input_schema": {"description": "x" * 20_000}}]}]}, 400, "input"),
    ({"input": [{"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "a b",
                 "name": "shout", "arguments": "{}"}]}, 400, "input"),
    ({"input": [{"type": "mcp_call", "id": "mcp_1", "server_label": "x", "name": "shout",
                 "arguments": "[1"}]}, 400, "input"),
    ({"input": [{"type": "mcp_call", "id": "mcp_1", "server_label": "x", "name": "shout",
                 "arguments": "{}", "status": "failed", "error": {"content": [5]}}]},
     400, "input"),
    # no connectors here; one token, not two
    ({"tools": [{"type": "mcp", "server_label": "x", "connector_id": "connector_gmail"}]},
     400, "tools"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1/mcp",
                 "authorization": "t", "headers": {"authorization": "Bearer u"}}]},
     400, "tools[0].authorization"),
])
def test_refusals_name_the_field(server, body, status, param):
    r = _request("POST", f"{server.url}/v1/responses", {"model": "tiny", "input": "hi", **body},
                 headers={"Authorization": f"Bearer {ALICE}"})
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    if param == "input":
        assert "'input[0]." in r.json()["error"]["message"], r.text
    if "connector_id" in json.dumps(body):
        assert "'tools[0].connector_id': connectors are not served" in r.text


def test_a_tenant_uses_only_the_tools_it_may(server, mcp_server):
    before = len(mcp_server.calls())
    body = {"model": "tiny", "input": "hi", "tools": [_tool(mcp_server)]}
    r = _request("POST", f"{server.url}/v1/responses", body,
                 headers={"Authorization": f"Bearer {BOB}"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "tools[0].type", r.text
    assert "'mcp'" in r.json()["error"]["message"]
    assert len(mcp_server.calls()) == before


def test_failures_are_what_the_model_reads(server, mcp_server):
    alice = _client(server)
    broken = alice.responses.create(
        model="tiny", input="Break it.", max_tool_calls=1, max_output_tokens=128,
        temperature=0,
        tools=[_tool(mcp_server, allowed_tools=["broken"], require_approval="never")],
        tool_choice={"type": "mcp", "server_label": "calc", "name": "broken"})
    assert [item.type for item in broken.output] == ["mcp_list_tools", "mcp_call", "message"]
    call = broken.output[1]
    assert (call.type, call.status) == ("mcp_call", "failed")
    assert call.error.type == "mcp_tool_execution_error"
    assert "broken" in call.error.content[0]["text"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is absent")
def test_code_interpreter_runs_the_model_s_code_in_the_sandbox(server):
    """code_interpreter end to end: the model's forced call, its code bounded by the schema it is
    offered (alice's own code_chars, 40), runs in the real sandbox; the call's item carries the
    sandbox's outcome (a random model's code rarely runs: then the item failed, and what the model
    read next is the sandbox's error), and the run is logged as steps."""
    r = _client(server).responses.create(
        model="tiny", input="Compute 2+2 in Python.", temperature=0, max_output_tokens=64,
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
        tool_choice={"type": "code_interpreter"}, max_tool_calls=1)
    (call,) = [item for item in r.output if item.type == "code_interpreter_call"]
    assert 1 <= len(call.code) <= 40
    assert call.status in ("completed", "failed")
    if call.status == "completed":  # it ran: the sandbox's logs are its output
        assert call.outputs[0].type == "logs"
    steps = _steps(server, r.id)
    assert [kind for kind, *_ in steps] == ["model_turn", "tool_call", "model_turn"]
    assert steps[1][1:3] == ("code_interpreter", call.status)


def test_a_failed_listing_is_a_424_naming_the_server(server):
    """As OpenAI's: a request whose MCP server cannot list its tools fails with 424 (streamed
    or not: nothing was sent yet) and is not stored; a background run ends `failed`."""
    alice = _client(server)
    gone = {"type": "mcp", "server_label": "gone",
            "server_url": f"http://127.0.0.1:{_free_port()}/mcp"}
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as e:
            alice.responses.create(model="tiny", input="hi", max_output_tokens=8, tools=[gone],
                                   stream=stream)
        assert e.value.status_code == 424
        error = e.value.body if "message" in e.value.body else e.value.body["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "external_connector_error", "http_error", "tools")
        assert error["message"].startswith(
            "Error retrieving tool list from MCP server: 'gone'."), error
    with sqlite3.connect(server.data_dir / FILE_NAME) as db:
        assert not db.execute("SELECT id FROM responses WHERE settings LIKE '%gone%' AND "
                              "background=0").fetchall()
    queued = alice.responses.create(model="tiny", input="hi", max_output_tokens=8,
                                    tools=[gone], background=True)
    wait_for(lambda: alice.responses.retrieve(queued.id).status == "failed", "the failed run")
    failed = alice.responses.retrieve(queued.id)
    assert failed.error.code == "http_error" and "'gone'" in failed.error.message
    assert [(i.type, i.status) for i in failed.output] == [("mcp_list_tools", "failed")]


def test_a_token_goes_to_the_server_and_nowhere_else(server, mcp_server):
    """`authorization` is sent as the bearer token, not echoed and not stored;
    `server_description` is offered to the model with the server's tools; connector_id is a
    400 (in test_refusals_name_the_field)."""
    alice = _client(server)
    token = "tok-a3-" + "7" * 24

    def create(**fields):
        return alice.responses.create(
            model="tiny", input="Shout a word.", max_tool_calls=1, max_output_tokens=128,
            temperature=0, tool_choice={"type": "mcp", "server_label": "calc", "name": "shout"},
            tools=[_tool(mcp_server, allowed_tools=["shout"], **fields)])

    called = create(require_approval="never", authorization=token)
    assert [i.type for i in called.output][:2] == ["mcp_list_tools", "mcp_call"], called
    (made,) = [c for c in mcp_server.calls() if c["step_id"].startswith(called.id)]
    assert made["authorization"] == f"Bearer {token}"
    assert "authorization" not in called.tools[0].model_dump(exclude_none=True)
    assert token not in json.dumps(alice.responses.retrieve(called.id).model_dump())
    for name in (FILE_NAME, FILE_NAME + "-wal"):  # the database's bytes, its log's too
        path = server.data_dir / name
        assert not path.exists() or token.encode() not in path.read_bytes()
    # The server's description is in the model's prompt: the same request, longer by it.
    plain = create()
    described = create(server_description="Shouting as a service for the calc tests.")
    assert [i.type for i in described.output] == ["mcp_list_tools", "mcp_approval_request"]
    assert described.usage.input_tokens > plain.usage.input_tokens + 8


def test_mcp_items_sent_back_as_input(server, mcp_server):
    """A client that keeps its own history (store false, no previous_response_id) sends the
    listing, the approval request and its approval back: the listing is used as it is and the
    approved call made; sent back with its mcp_call too, the call is not made again."""
    alice = _client(server)
    tools = [_tool(mcp_server, allowed_tools=["shout"])]
    first = alice.responses.create(
        model="tiny", input="Shout a word.", tools=tools, max_tool_calls=1, store=False,
        tool_choice={"type": "mcp", "server_label": "calc", "name": "shout"},
        max_output_tokens=128, temperature=0)
    listing, request = first.output
    assert (listing.type, request.type) == ("mcp_list_tools", "mcp_approval_request")
    sent = listing.model_dump(exclude_none=True)
    for tool in sent["tools"]:
        del tool["description"]  # optional in OpenAI's shape
    history = [{"role": "user", "content": "Shout a word."}, sent,
               request.model_dump(exclude_none=True),
               {"type": "mcp_approval_response", "approval_request_id": request.id,
                "approve": True}]
    second = alice.responses.create(model="tiny", input=history, tools=tools, store=False,
                                    max_tool_calls=1, max_output_tokens=16)
    call = second.output[0]
    assert (call.type, call.status, call.approval_request_id) == ("mcp_call", "completed",
                                                                  request.id), second
    assert call.output == json.loads(request.arguments)["text"].upper() + "!"
    assert "mcp_list_tools" not in [i.type for i in second.output]  # the client's listing
    assert len([c for c in mcp_server.calls() if c["step_id"].startswith(second.id)]) == 1
    third = alice.responses.create(
        model="tiny", input=history + [call.model_dump(exclude_none=True)], tools=tools,
        store=False, tool_choice="none", max_output_tokens=8)
    assert [i.type for i in third.output] == ["message"], third
    assert not [c for c in mcp_server.calls() if c["step_id"].startswith(third.id)]


# ---------------------------------------------------------------- host side


class SlowAddTurns:
    """Scripted model turns: each calls slow_add while tools are offered, else answers."""

    async def __call__(self, items, tool_texts, tools_allowed):
        if tools_allowed:
            return TurnResult([{"type": "function_call", "id": "fc_1", "call_id": "c",
                                "name": "slow_add", "arguments": '{"a": 2, "b": 40}',
                                "status": "completed"}], {}, "tool_calls")
        return TurnResult([{"type": "message", "id": "msg", "role": "assistant",
                            "status": "completed", "content": []}], {}, "stop")


def test_an_interrupted_call_is_reissued_with_its_step_id(tmp_path, mcp_server):
    store = ResponseStore(StoreConfig(tmp_path))
    limits = McpLimits(("127.0.0.1",))
    config = {"type": "mcp", "server_label": "calc", "server_url": mcp_server.url,
              "require_approval": "never"}

    def run() -> Run:
        return Run("resp_mcp", "acme", store, {"mcp:calc": (McpTools(limits), config)},
                   SlowAddTurns(), max_tool_calls=1)

    def made() -> list[dict]:
        return [c for c in mcp_server.calls() if c["step_id"].startswith("resp_mcp.")]

    async def interrupted():
        task = asyncio.create_task(run().execute([]))
        while not made():
            await asyncio.sleep(0.02)
        task.cancel(SHUTDOWN)  # a server going down: the started step stays `started`
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    steps = store.steps("resp_mcp")
    assert [(s.kind, s.status) for s in steps] == [
        ("list_tools", "completed"), ("model_turn", "completed"), ("tool_call", "started")]
    result = asyncio.run(run().execute([]))
    assert [(item["type"], item.get("status")) for item in result.output] == [
        ("mcp_list_tools", "completed"), ("mcp_call", "completed"), ("message", "completed")]
    assert result.output[1]["output"] == "42"
    assert result.output[0] == steps[0].output["item"]  # the listing taken from the log
    steps = store.steps("resp_mcp")
    assert [(s.kind, s.status, s.attempts) for s in steps] == [
        ("list_tools", "completed", 1), ("model_turn", "completed", 1),
        ("tool_call", "completed", 2), ("model_turn", "completed", 1)]
    assert [c["step_id"] for c in made()] == ["resp_mcp.step002"] * 2  # the same key again
    asyncio.run(run().execute([]))  # completed: nothing runs again
    assert len(made()) == 2
    store.close()


def test_bounds_on_what_a_server_sends(mcp_server):
    config = {"type": "mcp", "server_label": "calc", "server_url": mcp_server.url}
    context = ToolContext("acme", "resp_b", "resp_b.step001", None)

    async def huge(limits: McpLimits):
        tools = McpTools(limits)
        listing = await tools.list(context, config, "mcpl_1")
        (function,) = [f for f in tools.functions(listing, config) if f.name == "huge"]
        return await function.execute(context, {}, config)

    text = asyncio.run(huge(McpLimits(("127.0.0.1",), max_output_chars=1000)))
    assert text.startswith("x" * 1000) and text.endswith("[cut: 100000 characters, 1000 kept]")
    with pytest.raises(ToolError) as e:  # 100 kB answer, 20 kB read: the read stops
        asyncio.run(huge(McpLimits(("127.0.0.1",), max_response_bytes=20_000)))
    assert "more than this server reads" in e.value.detail["message"], e.value.detail
    listing = asyncio.run(McpTools(McpLimits(("127.0.0.1",), max_tools=2)).list(
        context, config, "mcpl_2"))
    assert len(listing["tools"]) == 2


# ---------------------------------------------------------------- conversations


def _tokens(server, messages: list[dict]) -> int:
    r = _request("POST", f"{server.url}/tokenize", {"model": "tiny", "messages": messages},
                 headers={"Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_a_conversation_is_the_history_of_the_responses_naming_it(server):
    alice, bob = _client(server), _client(server, BOB)
    conv = alice.conversations.create(metadata={"topic": "zebra-conv-marker"}, items=[
        {"type": "message", "role": "user", "content": "Hello there."}])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "zebra-conv-marker"}
    first = alice.responses.create(model="tiny", input="Tell me more.", conversation=conv.id,
                                   max_output_tokens=8, temperature=0)
    assert first.conversation.id == conv.id
    items = alice.conversations.items.list(conv.id, order="asc").data
    text = "".join(p.text for p in items[2].content)
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"),
                                                 ("message", "assistant")]
    # The next response's prompt is the whole conversation (its token count equals /tokenize's).
    second = alice.responses.create(model="tiny", input="And then?", conversation=conv.id,
                                    max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens == _tokens(server, [
        {"role": "user", "content": "Hello there."}, {"role": "user", "content": "Tell me more."},
        {"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}])
    # Items: added, read one, deleted (the answer is the conversation), paged.
    added = alice.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "An aside."}])
    (aside,) = added.data
    assert alice.conversations.items.retrieve(aside.id, conversation_id=conv.id).id == aside.id
    assert alice.conversations.items.delete(aside.id, conversation_id=conv.id).id == conv.id
    every = [i.id for i in alice.conversations.items.list(conv.id, order="asc").data]
    assert len(every) == 5 and aside.id not in every
    page = alice.conversations.items.list(conv.id, limit=2, order="asc")
    assert len(page.data) == 2 and page.has_more
    rest = alice.conversations.items.list(conv.id, limit=10, order="asc", after=page.data[-1].id)
    assert [i.id for i in page.data + rest.data] == every and not rest.has_more
    newest = alice.conversations.items.list(conv.id, limit=2)  # desc by default
    assert [i.id for i in newest.data] == every[::-1][:2]
    assert alice.conversations.update(conv.id, metadata={"topic": "t2"}).metadata == {
        "topic": "t2"}
    # Another tenant's: not found, by the routes and by /v1/responses.
    with pytest.raises(openai.NotFoundError):
        bob.conversations.retrieve(conv.id)
    r = _request("POST", f"{server.url}/v1/responses", {"model": "tiny", "input": "x",
                                                        "conversation": conv.id},
                 headers={"Authorization": f"Bearer {BOB}"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "conversation"), r.text
    r = _request("POST", f"{server.url}/v1/responses", {
        "model": "tiny", "input": "x", "conversation": conv.id,
        "previous_response_id": first.id}, headers={"Authorization": f"Bearer {ALICE}"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "conversation"), r.text
    # Deleted: gone, its content out of the file.
    assert alice.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(conv.id)
    assert b"Hello there." not in (server.data_dir / "conversations.sqlite3").read_bytes()


# ---------------------------------------------------------------- the OpenAI Agents SDK


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(server, tmp_path):
    """The OpenAI Agents SDK (`openai-agents`) unchanged: its Responses model runs an agent whose
    function tool the SDK executes (the call forced, the run stopped on the tool's answer), then
    a second turn in the same session, which sends the whole history back as input items."""
    import agents  # here, not at the top: it loads OpenTelemetry and more, for this test only

    agents.set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    calls = []

    @agents.function_tool
    def lookup(city: Annotated[str, Field(max_length=8)]) -> str:
        """Look up the weather of a city."""
        calls.append(city)
        return f"{city}: sunny"

    async def conversation():
        model = agents.OpenAIResponsesModel("tiny", openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=ALICE, max_retries=0))
        agent = agents.Agent(
            name="weather", instructions="Answer with the lookup tool.", tools=[lookup],
            model=model, tool_use_behavior="stop_on_first_tool",
            model_settings=agents.ModelSettings(tool_choice="lookup", temperature=0,
                                                max_tokens=128))
        session = agents.SQLiteSession("s1", str(tmp_path / "session.db"))
        first = await agents.Runner.run(agent, "Weather in Paris?", session=session)
        second = await agents.Runner.run(agent, "And in Rome?", session=session)
        return first, second, await session.get_items()

    first, second, items = asyncio.run(conversation())
    assert len(calls) == 2
    assert (first.final_output, second.final_output) == (f"{calls[0]}: sunny",
                                                         f"{calls[1]}: sunny")
    kinds = [item.get("type", "message") for item in items]
    assert kinds.count("function_call") == 2 and kinds.count("function_call_output") == 2, kinds
    # The second turn's prompt is the whole conversation, the first call and its output included.
    assert second.raw_responses[0].usage.input_tokens > \
        first.raw_responses[0].usage.input_tokens + 10

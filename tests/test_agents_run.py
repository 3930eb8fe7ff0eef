"""The run state machine and the response store, host side and in milliseconds: a run's steps
written ahead and completed, a run interrupted by a shutdown and started again (completed steps
taken from the log, the interrupted tool call re-issued with the same step id, nothing completed
run twice), tool errors fed back to the model, max_tool_calls, and the store's tenancy, chains,
expiry and deletion. The model turns are scripted (the request path drives real ones: see
test_responses_store.py and test_agent_resume.py)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from jaxserve.agents.run import SHUTDOWN, Run, TurnResult
from jaxserve.agents.store import FILE_NAME, ResponseStore, StoreConfig
from jaxserve.agents.tools import ToolError
from jaxserve.errors import InvalidRequest

USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


class Lookup:
    """A server tool that counts its executions per step id; `fail`/`stop`: the step ids on
    which it raises a ToolError / is interrupted by a shutdown."""

    kind, item_type, description = "lookup", "lookup_call", "Look a word up."
    parameters = {"type": "object", "properties": {"word": {"type": "string"}}}

    def __init__(self, fail=(), stop=()):
        self.calls: list[str] = []
        self.fail, self.stop = set(fail), set(stop)

    async def execute(self, context, arguments, config):
        self.calls.append(context.step_id)
        if context.step_id in self.stop:
            raise asyncio.CancelledError(SHUTDOWN)
        if context.step_id in self.fail:
            raise ToolError("no such word")
        return {"meaning": arguments["word"].upper()}

    def item(self, item_id, arguments, status, result):
        return {"type": self.item_type, "id": item_id, "status": status,
                "word": arguments.get("word"), "result": result}

    def arguments(self, item):
        return {"word": item["word"]}

    def model_text(self, item):
        return str(item["result"])


class Turns:
    """Scripted model turns: each calls `lookup` while tools are offered, else answers."""

    def __init__(self):
        self.seen: list[tuple[int, dict, bool]] = []

    async def __call__(self, items, tool_texts, tools_allowed):
        self.seen.append((len(items), dict(tool_texts), tools_allowed))
        if tools_allowed:
            return TurnResult([{"type": "function_call", "id": f"fc_{len(self.seen)}",
                                "call_id": "c", "name": "lookup",
                                "arguments": f'{{"word": "w{len(self.seen)}"}}',
                                "status": "completed"}], USAGE, "tool_calls")
        return TurnResult([{"type": "message", "id": "msg", "role": "assistant",
                            "status": "completed", "content": []}], USAGE, "stop")


def _run(store, tool, turns, audit=None):
    return Run("resp_1", "acme", store, {"lookup": (tool, {"type": "lookup"})}, turns,
               max_tool_calls=2, audit=audit)


def test_a_run_interrupted_by_a_shutdown_resumes_without_repeating_a_completed_step(tmp_path):
    store = ResponseStore(StoreConfig(tmp_path))
    first = Lookup(stop={"resp_1.step003"})
    records = []
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_run(store, first, Turns(), records.append).execute([]))
    assert first.calls == ["resp_1.step001", "resp_1.step003"]
    assert [(s.kind, s.status) for s in store.steps("resp_1")] == [
        ("model_turn", "completed"), ("tool_call", "completed"), ("model_turn", "completed"),
        ("tool_call", "started")]  # the interrupted call stays started
    assert [(r.step_id, r.status) for r in records][-2:] == [
        ("resp_1.step003", "started"), ("resp_1.step003", "interrupted")]

    again, turns = Lookup(), Turns()
    result = asyncio.run(_run(store, again, turns).execute([]))
    assert again.calls == ["resp_1.step003"]  # re-issued with its step id; step001 not re-run
    assert [t[2] for t in turns.seen] == [False]  # only the last turn ran: no tool past 2 calls
    assert [i["type"] for i in result.output] == ["lookup_call", "lookup_call", "message"]
    assert [i["result"] for i in result.output[:2]] == [{"meaning": "W1"}, {"meaning": "W2"}]
    steps = store.steps("resp_1")
    assert [(s.kind, s.status, s.attempts) for s in steps] == [
        ("model_turn", "completed", 1), ("tool_call", "completed", 1),
        ("model_turn", "completed", 1), ("tool_call", "completed", 2),
        ("model_turn", "completed", 1)]
    assert result.usage["total_tokens"] == 3 * 2


def test_a_tool_error_is_what_the_model_reads(tmp_path):
    tool, turns = Lookup(fail={"r.step001"}), Turns()
    run = Run("r", "acme", None, {"lookup": (tool, {})}, turns, max_tool_calls=1)
    result = asyncio.run(run.execute([{"type": "message", "role": "user", "content": "x"}]))
    assert result.output[0]["status"] == "failed"
    assert turns.seen[1] == (2, {result.output[0]["id"]: "error: no such word"}, False)


def test_store_tenancy_chain_expiry_and_deletion(tmp_path):
    now = [1000.0]
    store = ResponseStore(StoreConfig(tmp_path, ttl_s=60), clock=lambda: now[0])

    def create(rid, previous=None, text="hi"):
        store.create("acme", {"id": rid, "status": "completed", "previous_response_id": previous,
                              "output": []}, {"model": "m"},
                     [{"type": "message", "role": "user", "content": text}], False, None)

    create("a", text="secret-words")
    create("b", previous="a")
    assert [s.id for s in store.chain("acme", "b")] == ["a", "b"]
    assert store.get("other", "a") is None
    with pytest.raises(InvalidRequest):
        store.chain("other", "b")
    assert not store.delete("other", "a") and store.delete("acme", "a")
    assert b"secret-words" not in b"".join(p.read_bytes() for p in tmp_path.iterdir()
                                           if p.name.startswith(FILE_NAME))
    with pytest.raises(InvalidRequest):  # the chain through a deleted response is broken
        store.chain("acme", "b")
    now[0] += 61
    assert store.get("acme", "b") is None
    assert store.purge_expired() == 1
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        assert db.execute("SELECT COUNT(*) FROM responses").fetchone() == (0,)

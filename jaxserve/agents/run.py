"""A run: the recorded state machine behind one response. Host side: no JAX.

A run alternates model turns and server-side tool calls until the model answers without calling
a server tool (a final message, or `function` calls the client executes), `max_tool_calls`
server calls were made (the next turn is then offered no tools), the deadline, or a cancel.

Every step is written to the step log (agents/store.py) *before* it runs — step id, position,
kind (model_turn / tool_call), tool, input, status `started` — and completed after (output,
status, timing), and each of these is one audit record (audit StepRecord, on the hash chain).
The step ids are the response id and the step's position, so a run started again (after a
restart) walks the same steps: a completed step is not run again, its recorded output is used;
a model turn started but not completed is run again; a tool call started but not completed is
issued again with the same step id (its idempotency key: ToolContext.step_id). So no completed
tool call runs twice.

A server tool is offered to the model as functions (`functions`: name -> the tool and its entry
of the request's `tools`): a plain tool as one function named by its kind; a tool that lists what
it offers (`listing_type`: remote MCP servers) as the functions of its listing, a step of its own
before the first turn (a listing already in the conversation is used again). A function whose
tool `needs_approval` is not called: the run ends with the tool's approval request item, and the
call is made by a following run whose input approves it (the tool's `approved`).

The model turn itself is the caller's (`TurnRunner`: the serving layer's request path, which
this layer sits below); so are the events a streamed run sends (`RunEvents`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from jaxserve.agents.store import ResponseStore, Step
from jaxserve.agents.tools import APPROVAL_ITEM, ServerTool, ToolContext, ToolError
from jaxserve.audit import StepRecord

DEFAULT_MAX_TOOL_CALLS = 16  # server tool calls of one run when the request names no bound
TOOL_TIMEOUT_S = 60.0  # one server tool call, at most (and never past the run's deadline)
# The message of the cancellation a server shutting down sends its runs (`task.cancel(SHUTDOWN)`):
# unlike a client's cancel, it leaves the run resumable.
SHUTDOWN = "server shutdown"


@dataclass(frozen=True)
class TurnResult:
    """One model turn: its output items (a server tool's call is a `function_call` item named by
    the tool's kind), its usage (chat's prompt/completion tokens) and finish reason."""

    items: list[dict]
    usage: dict
    finish: str | None

    def to_json(self) -> dict:
        return {"items": self.items, "usage": self.usage, "finish": self.finish}


class TurnRunner(Protocol):
    async def __call__(self, items: list[dict], tool_texts: dict[str, str],
                       tools_allowed: bool) -> TurnResult:
        """Run the model on the conversation `items` (Responses items; a server tool's completed
        call is read as `tool_texts[item id]` when there, else from its item); with
        `tools_allowed` False no tool is offered."""


class RunEvents(Protocol):
    """What a streamed run sends about its server tool calls (the turns send their own), and
    the items of the steps a resumed run takes from its log (sent before the restart)."""

    async def tool_started(self, item: dict) -> None: ...

    async def tool_done(self, item: dict) -> None: ...

    async def added(self, item: dict) -> None:
        """An item complete as it is made (an approval request)."""

    def recorded(self, items: list[dict]) -> None: ...


@dataclass
class RunResult:
    output: list[dict] = field(default_factory=list)
    usage: dict = field(default_factory=lambda: {"prompt_tokens": 0, "completion_tokens": 0,
                                                 "total_tokens": 0, "prompt_tokens_details": {
                                                     "cached_tokens": 0}})
    finish: str | None = None


class Run:
    def __init__(self, response_id: str, tenant: str, store: ResponseStore | None,
                 tools: dict[str, tuple[ServerTool, dict]], turn: TurnRunner,
                 events: RunEvents | None = None, *, max_tool_calls: int | None = None,
                 deadline_at: float | None = None,
                 audit: Callable[[StepRecord], None] | None = None):
        """`store` None: a run nobody stores (store false), its step log in memory only;
        `tools`: the request's server tools by a key of their own (the kind; an MCP server's
        label), each with its entry of `tools`."""
        self.response_id = response_id
        self.tenant = tenant
        self.store = store
        self.tools = tools
        self.turn = turn
        self.events = events
        self.max_tool_calls = DEFAULT_MAX_TOOL_CALLS if max_tool_calls is None \
            else max_tool_calls
        self.deadline_at = deadline_at
        self.audit = audit
        self._steps: list[Step] = store.steps(response_id) if store is not None else []
        self._position = 0
        # The functions offered to the model: name -> (tool, its entry of `tools`).
        self.functions: dict[str, tuple[ServerTool, dict]] = {
            tool.kind: (tool, config) for tool, config in tools.values()
            if getattr(tool, "listing_type", None) is None}

    def step_id(self, position: int) -> str:
        return f"{self.response_id}.step{position:03d}"

    async def execute(self, conversation: list[dict]) -> RunResult:
        result = RunResult()
        tool_texts: dict[str, str] = {}
        calls = 0
        for tool, config in self.tools.values():
            if getattr(tool, "listing_type", None) is not None:
                await self._offer(tool, config, conversation, result)
        for tool, config in self.tools.values():
            if getattr(tool, "listing_type", None) is not None:
                result.output += tool.approved(conversation, config, self.functions)
        while True:
            pending = [i for i, item in enumerate(result.output)
                       if item.get("status") == "in_progress" and self._tool_of(item)]
            if pending:
                index = pending[0]
                item, text = await self._tool_step(result.output[index])
                result.output[index] = item
                tool_texts[item["id"]] = text
                calls += 1
                continue
            if result.finish is not None:
                return result
            allowed = self.max_tool_calls - calls
            turn = await self._turn_step(conversation + result.output, tool_texts, allowed)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                result.usage[key] += turn.usage.get(key, 0)
            result.usage["prompt_tokens_details"]["cached_tokens"] += (
                turn.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            result.output.extend(turn.items)
            if not any(self._tool_of(item) for item in turn.items) or any(
                    item["type"] == APPROVAL_ITEM for item in turn.items):
                result.finish = turn.finish or "stop"

    def _tool_of(self, item: dict) -> tuple[ServerTool, dict] | None:
        for tool, _ in self.functions.values():
            if item.get("type") == tool.item_type:
                name = tool.call_name(item) if hasattr(tool, "call_name") else tool.kind
                entry = self.functions.get(name)
                return entry if entry is not None and entry[0].item_type == item["type"] \
                    else None
        return None

    async def _offer(self, tool: ServerTool, config: dict, conversation: list[dict],
                     result: RunResult) -> None:
        """The functions of a tool that lists them: from its listing in the conversation, else
        from one it makes now (a step; its item goes to the output)."""
        listing = tool.listing_in(conversation, config)
        if listing is None:
            async def work(step_id: str):
                item_id = f"{tool.listing_type[:4]}_{secrets.token_hex(16)}"
                if self.events is not None:
                    await self.events.tool_started(tool.listing(item_id, config, "in_progress"))
                context = ToolContext(self.tenant, self.response_id, step_id, self.deadline_at)
                item = await tool.list(context, config, item_id)
                if self.events is not None:
                    await self.events.tool_done(item)
                return item["status"], {"item": item}

            listing = (await self._step("list_tools", tool.kind, {
                "server": config.get("server_label")}, work))["item"]
            result.output.append(listing)
            if listing["status"] == "failed":  # the run cannot offer what was asked
                raise tool.failure(config, listing)
        for function in tool.functions(listing, config):
            if function.name in self.functions:  # a name taken first keeps it
                continue
            self.functions[function.name] = (function, config)

    # ---------------------------------------------------------------- steps

    async def _step(self, kind: str, tool: str | None, step_input: Any,
                    work: Callable[[str], Awaitable[tuple[str, Any]]]) -> Any:
        """The step at the next position: its recorded output when it completed before, else
        `work(step_id)` -> (status, output), written ahead and completed in the log."""
        position = self._position
        self._position += 1
        step_id = self.step_id(position)
        done = self._steps[position] if position < len(self._steps) else None
        if done is not None and done.status in ("completed", "failed"):
            assert done.kind == kind, (done, kind)  # a run walks its steps in the same order
            if self.events is not None:
                self.events.recorded(done.output["items"] if kind == "model_turn"
                                     else [done.output["item"]])
            return done.output
        attempt = 1 if done is None else done.attempts + 1
        if self.store is not None and self.store.status(self.response_id) == "cancelled":
            raise asyncio.CancelledError()  # cancelled through another server
        if self.store is not None:
            self.store.begin_step(self.response_id, step_id, position, kind, tool, step_input)
        self._record(step_id, kind, tool, "started", attempt)
        started = time.monotonic()
        status, output = "error", None
        try:
            status, output = await work(step_id)
            return output
        except asyncio.CancelledError as e:
            # A shutdown leaves it `started`: the restarted server runs it again.
            status = "interrupted" if e.args == (SHUTDOWN,) else "cancelled"
            raise
        except Exception as e:
            output = {"error": str(e)}
            raise
        finally:
            if self.store is not None and status != "interrupted":
                self.store.end_step(step_id, status, output)
            self._record(step_id, kind, tool, status, attempt, time.monotonic() - started)

    def _record(self, step_id: str, kind: str, tool: str | None, status: str, attempt: int,
                duration_s: float | None = None) -> None:
        if self.audit is not None:
            self.audit(StepRecord(self.response_id, step_id, kind, status, self.tenant, tool,
                                  attempt, None if duration_s is None else round(duration_s, 4)))

    async def _turn_step(self, items: list[dict], tool_texts: dict[str, str],
                         allowed: int) -> TurnResult:
        """A model turn that may make `allowed` more server tool calls (none: no tools)."""
        async def work(step_id: str):
            turn = self._with_tool_items(await self.turn(items, tool_texts, allowed > 0),
                                         allowed)
            for item in turn.items:
                if item["type"] == APPROVAL_ITEM and self.events is not None:
                    await self.events.added(item)
            return "completed", turn.to_json()

        out = await self._step("model_turn", None, {"items": len(items),
                                                    "tools": allowed > 0}, work)
        return TurnResult(out["items"], out["usage"], out["finish"])

    def _with_tool_items(self, turn: TurnResult, allowed: int) -> TurnResult:
        """A server tool's call, from the model's function call to its own item (or, when the
        tool needs approval, its approval request); one that max_output_tokens cut is dropped
        (the run ends incomplete), and so are those past max_tool_calls (as OpenAI's API
        ignores them)."""
        items = []
        for item in turn.items:
            entry = self.functions.get(item.get("name")) \
                if item["type"] == "function_call" else None
            if entry is not None and (turn.finish == "length" or allowed == 0):
                continue
            if entry is not None:
                tool = entry[0]
                arguments = _arguments(item["arguments"])
                if getattr(tool, "needs_approval", False):
                    item = tool.approval_request(f"mcpr_{secrets.token_hex(16)}", arguments)
                else:
                    allowed -= 1
                    item = tool.item(f"{tool.item_type[:2]}_{secrets.token_hex(16)}",
                                     arguments, "in_progress", None)
            items.append(item)
        return TurnResult(items, turn.usage, turn.finish)

    async def _tool_step(self, item: dict) -> tuple[dict, str]:
        tool, config = self._tool_of(item)
        arguments = tool.arguments(item)

        async def work(step_id: str):
            if self.events is not None:
                await self.events.tool_started(item)
            result = await self._call(tool, config, item, arguments, step_id)
            if self.events is not None:
                await self.events.tool_done(result[1]["item"])
            return result

        out = await self._step("tool_call", tool.kind, {"item_id": item["id"],
                                                        "arguments": arguments}, work)
        return out["item"], out["text"]

    async def _call(self, tool: ServerTool, config: dict, item: dict, arguments: dict,
                    step_id: str) -> tuple[str, dict]:
        """(status, {"item", "text"}) of one execution: a ToolError or a timeout is `failed`
        with its message as what the model reads."""
        context = ToolContext(self.tenant, self.response_id, step_id, self.deadline_at)
        timeout = TOOL_TIMEOUT_S
        if self.deadline_at is not None:
            timeout = max(0.0, min(timeout, self.deadline_at - time.time()))
        detail = None
        try:
            async with asyncio.timeout(timeout):
                result = await tool.execute(context, arguments, config)
        except ToolError as e:
            error, detail = f"error: {e}", e.detail
        except TimeoutError:
            error = f"error: the tool did not answer within {timeout:g} s"
        else:
            done = _with_fields_of(tool.item(item["id"], arguments, "completed", result), item)
            return "completed", {"item": done, "text": tool.model_text(done)}
        failed = _with_fields_of(tool.item(item["id"], arguments, "failed", None), item)
        if "error" in failed:  # an item with a field for it carries the error too
            failed["error"] = detail if detail is not None else error.removeprefix("error: ")
        return "failed", {"item": failed, "text": error}


def _with_fields_of(done: dict, started: dict) -> dict:
    """A call's item as it ended, with what its started item said that the end leaves empty
    (an approved MCP call's approval_request_id)."""
    return {**done, **{k: v for k, v in started.items() if done.get(k) is None
                       and v is not None and k in done}}


def _arguments(text: str) -> dict:
    """A call's arguments, generated under the tool's schema (so JSON); anything else reads as
    no arguments, which the tool refuses with a ToolError the model sees."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

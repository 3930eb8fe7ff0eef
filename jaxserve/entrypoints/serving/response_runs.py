"""The runs behind POST /v1/responses: a validated request -> a `ResponseJob` (its conversation
rebuilt from its previous_response_id chain, its server tools, its deadline), and `execute`,
which drives its agents.run.Run with model turns on the chat path (each turn one call through
OpenAIServing: admitted, limited, counted and audited as any chat request) and sends its events
to `emit`. A stored response is written as it starts and as it ends; its run's steps as they go
(agents/store.py). Used alike by a request that waits for its answer and by a background run
(entrypoints/http/responses_routes.py owns both). No JAX.

How a run ends (the response's `status`): completed; incomplete (max_output_tokens, or the
deadline: `incomplete_details.reason` "deadline"); failed (an error after the run started, in
`error`); cancelled (a client's cancel, or a client that left while waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from jaxserve.agents.conversations import ConversationStore
from jaxserve.agents.file_search import searched_files
from jaxserve.agents.mcp_tools import APPROVAL_REQUEST, APPROVAL_RESPONSE, LIST_ITEM
from jaxserve.agents.run import SHUTDOWN, Run, TurnResult
from jaxserve.agents.store import UNFINISHED, ResponseStore
from jaxserve.agents.tools import ServerTool, ToolRegistry
from jaxserve.errors import DeadlineExceeded, InvalidRequest, error_reply, error_status
from jaxserve.gateway import Principal
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.responses import (ResponseEvents, ResponseObject, chat_body,
                                                    input_items, rename_param)

log = logging.getLogger(__name__)
ROUTE = "/v1/responses"
Emit = Callable[[dict | None], Awaitable[None]]  # an event (None: a keep-alive)


@dataclass
class ResponseJob:
    req: Any  # the validated ResponsesRequest
    response: ResponseObject
    principal: Principal
    input_items: list[dict]
    conversation: list[dict]  # the chain's items, then input_items
    # kind (an MCP server: "mcp:" + its label) -> (tool, its `tools` entry)
    server_tools: dict[str, tuple[ServerTool, dict]]
    deadline_at: float | None  # unix time
    # why its route degraded any of its model turns (x-jaxserve-degraded), as they run
    degraded: set[str] = field(default_factory=set)

    @property
    def tenant(self) -> str:
        return self.principal.tenant.name

    @property
    def stored(self) -> bool:
        return self.req.store is not False


class ResponseRunner:
    def __init__(self, serving, store: Callable[[], ResponseStore], tools: ToolRegistry,
                 keepalive_s: float, audit=None,
                 conversations: Callable[[], ConversationStore] | None = None):
        """`serving`: the OpenAIServing; `store`: the store, opened on first use;
        `audit`: an AuditLog (its `write`), or None; `conversations`: the conversation store,
        opened on first use (None: `conversation` is not served)."""
        self.serving = serving
        self._store = store
        self._conversations = conversations
        self.tools = tools
        self.keepalive_s = keepalive_s
        self.audit = audit

    @property
    def store(self) -> ResponseStore:
        return self._store()

    @property
    def conversations(self) -> ConversationStore:
        if self._conversations is None:
            raise InvalidRequest("conversations are not served here", param="conversation")
        return self._conversations()

    def job(self, req: Any, principal: Principal, timeout_s: float | None,
            response: ResponseObject | None = None, items: list[dict] | None = None,
            deadline_at: float | None = None) -> ResponseJob:
        """The job of a new request (`timeout_s`: X-Request-Timeout), or of a stored one
        resumed (`response`, `items` and `deadline_at` as stored). InvalidRequest naming the
        field for a chain that cannot be followed or a server tool this server lacks."""
        items = input_items(req) if items is None else items
        history: list[dict] = []
        if req.previous_response_id is not None:
            chain = self.store.chain(principal.tenant.name, req.previous_response_id)
            if chain[-1].status in UNFINISHED:
                raise InvalidRequest(f"Previous response '{req.previous_response_id}' is still "
                                     f"{chain[-1].status}: wait until it has ended",
                                     param="previous_response_id")
            for stored in chain:
                history += stored.input_items + stored.response["output"]
        elif req.conversation_id is not None:
            history = self.conversations.items(principal.tenant.name, req.conversation_id,
                                               param="conversation")
        server_tools = {}
        for i, entry in enumerate(req.tools or ()):
            if entry.type == "function":
                continue
            principal.tenant.check_tool(entry.type, f"tools[{i}].type")
            tool = self.tools.get(entry.type)
            if tool is None:
                raise InvalidRequest(f"the tool type {entry.type!r} is not available on this "
                                     f"server", param=f"tools[{i}].type")
            tool = tool.for_tenant(principal.tenant.name)
            key = entry.type
            if entry.type == "mcp":
                tool.check(entry.model_dump(), f"tools[{i}]")
                key = f"mcp:{entry.server_label}"
                if key in server_tools:
                    raise InvalidRequest(f"two mcp tools have the server_label "
                                         f"{entry.server_label!r}",
                                         param=f"tools[{i}].server_label")
            server_tools[key] = (tool, entry.model_dump(exclude_none=True))
        _check_approvals(items, history)
        if deadline_at is None:
            limits = [t for t in (timeout_s, principal.tenant.request_timeout_s)
                      if t is not None]
            deadline_at = time.time() + min(limits) if limits else None
        return ResponseJob(req, response or ResponseObject(req), principal, items,
                           history + items, server_tools, deadline_at)

    async def execute(self, job: ResponseJob, emit: Emit, call: Call | None = None,
                      sequence: int | None = None, client: str | None = None) -> dict:
        """Run the job to its end; the final response (written to the store when stored).
        `call`: the request's own call, ended by the first model turn (later turns are calls of
        their own). A request's run (`sequence` None) sends response.created once its first
        turn is admitted (or its MCP listing starts): an error before that propagates (the
        request's plain error reply).
        A background run (its response.created went out at its creation; `sequence`: its next
        event's number) starts with response.in_progress. After the first event, an error
        ends the run `failed`."""
        events = ResponseEvents(job.response, sequence=sequence or 0)
        state = {"call": call, "opened": sequence is not None}
        if sequence is not None:
            if job.stored:
                self.store.save(job.response.build("in_progress", []))
            await emit(events.started())

        async def opened() -> None:
            """response.created and .in_progress, before the run's first event (then the
            listings made before it)."""
            if not state["opened"]:
                state["opened"] = True
                for event in events.opening():
                    await emit(event)
                await run_events.flush()

        async def turn(items: list[dict], tool_texts: dict[str, str],
                       allowed: bool) -> TurnResult:
            tools = {name: entry[0] for name, entry in run.functions.items()}
            events.hidden = frozenset(tools)  # read as the run's, not streamed as functions
            events.files = searched_files(items)
            body = chat_body(job.req, items, tools, tool_texts, allowed)
            remaining = None
            if job.deadline_at is not None:
                remaining = job.deadline_at - time.time()
                if remaining <= 0:
                    raise DeadlineExceeded("the response's deadline passed")
            ctx = CallContext(job.principal, remaining, client=client, route=ROUTE)
            this_call, state["call"] = state["call"] or Call(self.serving.sinks), None
            try:
                gen = await self.serving.prepare_async("chat", body, ctx, this_call)
            except InvalidRequest as exc:
                raise rename_param(exc) from None
            job.degraded.update(gen.degraded)
            await opened()
            async with gen.running():
                async for event in events.turn(gen.chunks(self.keepalive_s)):
                    await emit(event)
            usage = events.usage or {}  # none: the stream ended before its usage chunk
            return TurnResult(events.items, usage, events.finish)

        run_events = _Events(events, emit, opened, lambda: state["opened"])
        run = Run(job.response.id, job.tenant, self.store if job.stored else None,
                  job.server_tools, turn, run_events,
                  max_tool_calls=job.req.max_tool_calls, deadline_at=job.deadline_at,
                  audit=self.audit.write if self.audit is not None else None)
        try:
            result = await run.execute(job.conversation)
            status = "completed" if result.finish in ("stop", "tool_calls") else "incomplete"
            final = job.response.build(status, result.output, result.usage, result.finish)
            if job.req.conversation_id is not None:  # the turn joins the conversation
                self.conversations.add(job.tenant, job.req.conversation_id,
                                       job.input_items + result.output, param="conversation")
        except BaseException as exc:
            if not state["opened"]:  # refused: as a stored response it never existed
                if job.stored:
                    self.store.delete(job.tenant, job.response.id)
                raise
            if isinstance(exc, asyncio.CancelledError):
                if exc.args != (SHUTDOWN,):  # a shutdown leaves it for the restarted server
                    final = job.response.build("cancelled", events.output)
                    self._end(job, final)
                    with contextlib.suppress(Exception):  # a client that left reads nothing
                        await emit(events.closing(final))
                raise
            if isinstance(exc, DeadlineExceeded):
                final = job.response.build("incomplete", events.output,
                                           finish_reason="deadline")
            elif isinstance(exc, Exception):
                if error_status(exc).http == 500:
                    log.exception("the run of %s failed", job.response.id, exc_info=exc)
                body = error_reply(exc)[1]["error"]
                final = job.response.build("failed", events.output, error={
                    "code": body.get("code") or body["type"], "message": body["message"]})
            else:
                raise
        self._end(job, final)
        await emit(events.closing(final))
        return final

    def _end(self, job: ResponseJob, final: dict) -> None:
        if job.stored:
            self.store.save(final)


def _check_approvals(items: list[dict], history: list[dict]) -> None:
    """Each mcp_approval_response of the input answers an approval request before it (of the
    chain, or of the input itself)."""
    requests = {i["id"] for i in history if i.get("type") == APPROVAL_REQUEST}
    for i, item in enumerate(items):
        if item.get("type") == APPROVAL_REQUEST:
            requests.add(item["id"])
        elif item.get("type") == APPROVAL_RESPONSE and \
                item["approval_request_id"] not in requests:
            raise InvalidRequest(f"no mcp_approval_request {item['approval_request_id']!r} "
                                 f"before it (in the previous_response_id chain or the input)",
                                 param=f"input[{i}].approval_request_id")


class _Events:
    """agents.run.RunEvents: a server tool's call as Responses events. An MCP listing made
    before the response opened is held until it does (`flush`): a listing that fails ends the
    run first, and the request then gets its plain error reply (424), as OpenAI's."""

    def __init__(self, events: ResponseEvents, emit: Emit, opened: Callable[[], Awaitable],
                 is_open: Callable[[], bool]):
        """`opened()`: the response's opening events, sent unless they were."""
        self.events = events
        self.emit = emit
        self.opened = opened
        self.is_open = is_open
        self.held: dict[str, list[dict]] = {}  # item id -> a listing's items: started, done

    async def tool_started(self, item: dict) -> None:
        if item["type"] == LIST_ITEM and not self.is_open():
            self.held[item["id"]] = [item]
            return
        await self.opened()
        for event in self.events.tool_started(item):
            await self.emit(event)

    async def tool_done(self, item: dict) -> None:
        if item["id"] in self.held:
            self.held[item["id"]].append(item)
            return
        for event in self.events.tool_done(item):
            await self.emit(event)

    async def flush(self) -> None:
        """The held listings' events, now that the response is open."""
        held, self.held = self.held, {}
        for started, *done in held.values():
            for event in self.events.tool_started(started) + [
                    e for item in done for e in self.events.tool_done(item)]:
                await self.emit(event)

    async def added(self, item: dict) -> None:
        for event in self.events.added(item):
            await self.emit(event)

    def recorded(self, items: list[dict]) -> None:
        """Their events went out before the restart; a call's item replaces its earlier
        state."""
        output = self.events.output
        for item in items:
            index = next((i for i, it in enumerate(output) if it["id"] == item["id"]), None)
            if index is None:
                output.append(item)
            else:
                output[index] = item

"""The Responses API routes: POST /v1/responses (answered whole or streamed, or run in the
background), GET /v1/responses/{id} (with `stream=true&starting_after=N`: a background run's
recorded stream replayed, then followed live), DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel.

Responses are stored (agents/store.py, under --data-dir) unless `store` is false, and are their
tenant's: another tenant's is a 404 as a missing one is. A background run is a task the server
owns (agents/background.py), stamped with the server's token (agents/owners.py); a server
started on the data directory resumes, from their step logs, the runs whose server is gone, once
its engine is ready (`resume_runs`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from aiohttp import web

from jaxserve.agents.background import BackgroundRuns
from jaxserve.agents.code_interpreter import CodeInterpreter
from jaxserve.agents.file_search import FileSearch
from jaxserve.agents.mcp_tools import McpLimits, McpTools
from jaxserve.agents.owners import RunOwner
from jaxserve.agents.store import FILE_NAME, UNFINISHED, ResponseStore, StoreConfig
from jaxserve.agents.tools import ToolRegistry
from jaxserve.config import ServerConfig
from jaxserve.errors import InvalidRequest, NotFound
from jaxserve.gateway import Principal, idempotency
from jaxserve.entrypoints.http import conversation_routes
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.conversation_routes import CONVERSATIONS_KEY, Conversations
from jaxserve.entrypoints.http.front_door import call_context, call_of, caller
from jaxserve.entrypoints.http.json_body import read_json
from jaxserve.entrypoints.http.openai_routes import keyed
from jaxserve.entrypoints.http.openapi import Route
from jaxserve.entrypoints.http.sse import SSE_HEADERS, Keep, sse
from jaxserve.entrypoints.serving import degradation
from jaxserve.entrypoints.serving import response_models as out
from jaxserve.entrypoints.serving.request_models import request_models
from jaxserve.entrypoints.serving.response_runs import ResponseJob, ResponseRunner
from jaxserve.entrypoints.serving.responses import ResponseEvents, ResponseObject
from jaxserve.entrypoints.serving.streams import write_within
from jaxserve.entrypoints.serving.validation import validate

log = logging.getLogger(__name__)
MAX_LIST = 100  # input_items per page


class Responses:
    """The app's stored responses: the store (opened on first use), the background runs, and
    the runner once the engine is attached."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self._store: ResponseStore | None = None
        self.runs = BackgroundRuns()
        self.owner = RunOwner(config.data_dir)
        self.runner: ResponseRunner | None = None

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            self._store = ResponseStore(self.config)
        return self._store

    def stored_any(self) -> bool:
        return self._store is not None or (Path(self.config.data_dir).expanduser()
                                           / FILE_NAME).exists()

    def close(self) -> None:
        self.runs.close()
        self.owner.close()


RESPONSES_KEY = web.AppKey("responses", Responses)


def _responses(request: web.Request) -> Responses:
    return request.app[RESPONSES_KEY]


def _runner(request: web.Request) -> ResponseRunner:
    request.app[STATE_KEY].require_serving()  # 503 while warming up
    return request.app[RESPONSES_KEY].runner


# ---------------------------------------------------------------- POST /v1/responses


async def create(request: web.Request) -> web.StreamResponse:
    state: AppState = request.app[STATE_KEY]
    runner = _runner(request)
    req = validate(request_models(state.config.limits).responses, await read_json(request))
    ctx = call_context(request)
    return await keyed(request, ctx, "chat", req.model,
                       lambda keep: _create(request, runner, req, ctx, keep))


async def _create(request: web.Request, runner: ResponseRunner, req, ctx, keep: Keep | None
                  ) -> web.StreamResponse:
    responses = _responses(request)
    job = runner.job(req, ctx.principal, ctx.timeout_s)
    if req.background:
        return await _background(request, responses, job, keep)
    if job.stored:  # removed again if the run is refused (response_runs.execute)
        _store_new(responses.store, job, "in_progress")
    if req.stream:
        return await _stream(request, runner, job, keep)
    final = await runner.execute(job, _discard, call_of(request), client=request.remote)
    resp = web.json_response(final, headers=_degraded(job))
    _keep(keep, resp)
    return resp


def _degraded(job: ResponseJob) -> dict[str, str]:
    """x-jaxserve-degraded: why the route degraded any of the run's model turns so far."""
    return degradation.headers(tuple(sorted(job.degraded)))


def _store_new(store: ResponseStore, job: ResponseJob, status: str,
               owner: str | None = None) -> None:
    settings = job.req.model_dump(mode="json", by_alias=True, exclude_none=True)
    for tool in settings.get("tools", ()):
        # An MCP token is never stored (a background run resumed after a restart goes on
        # without it); only such a run needs an MCP tool's headers.
        tool.pop("authorization", None)
        if not job.req.background:
            tool.pop("headers", None)
    store.create(job.tenant, job.response.build(status, []), settings, job.input_items,
                 bool(job.req.background), job.deadline_at, owner)


def _keep(keep: Keep | None, resp: web.Response) -> None:
    if keep is not None:  # its headers replayed too (x-jaxserve-degraded)
        keep(idempotency.StoredResponse(200, (("Content-Type", resp.content_type),
                                              *((k, v) for k, v in resp.headers.items()
                                                if k.lower() == degradation.HEADER)),
                                        body=resp.body))


async def _discard(event: dict | None) -> None:
    return None


async def _stream(request: web.Request, runner: ResponseRunner, job: ResponseJob,
                  keep: Keep | None) -> web.StreamResponse:
    """A run's events as they happen. The status line waits for the first event (sent once
    the first model turn is admitted), so a refusal is a plain error reply."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    sent: list[bytes] = []
    timeout_s = request.app[STATE_KEY].config.stream_write_timeout_s

    async def emit(event: dict | None) -> None:
        if not resp.prepared:  # after the first model turn was admitted: its degradation known
            resp.headers.update(_degraded(job))
            await resp.prepare(request)
        data = b": keep-alive\n\n" if event is None else sse(event, event["type"])
        if event is not None:
            sent.append(data)
        await write_within(resp.write(data), timeout_s)

    await runner.execute(job, emit, call_of(request), client=request.remote)
    if keep is not None:
        keep(idempotency.StoredResponse(200, (("Content-Type", "text/event-stream"),
                                              *_degraded(job).items()), events=tuple(sent)))
    await resp.write_eof()
    return resp


async def _background(request: web.Request, responses: Responses, job: ResponseJob,
                      keep: Keep | None) -> web.StreamResponse:
    """Stored `queued` and started as the server's task; answered at once: the queued response,
    or (stream) its recorded stream followed."""
    store = responses.store
    _store_new(store, job, "queued", responses.owner.hold())
    opening = ResponseEvents(job.response).opening("queued")
    if job.req.stream:
        for event in opening:
            store.add_event(job.response.id, event)
    _start(responses, job, len(opening))
    if job.req.stream:
        return await _follow(request, responses, job.response.id, -1)
    resp = web.json_response(job.response.build("queued", []))
    _keep(keep, resp)
    return resp


def _start(responses: Responses, job: ResponseJob, sequence: int) -> None:
    store, runs, rid = responses.store, responses.runs, job.response.id

    async def record(event: dict | None) -> None:
        if event is not None and job.req.stream:
            store.add_event(rid, event)
            runs.notify(rid)

    runs.start(rid, responses.runner.execute(job, record, sequence=sequence))


def resume_runs(app: web.Application) -> None:
    """The engine is attached: build the runner, and resume the background runs this data
    directory's last server left unfinished (when this process owns them)."""
    state: AppState = app[STATE_KEY]
    responses = app[RESPONSES_KEY]
    serving = state.serving
    tools = ToolRegistry(_server_tools(state))
    audit = state.policy.audit if state.policy is not None else None
    conversations = app[CONVERSATIONS_KEY]
    responses.runner = ResponseRunner(serving, lambda: responses.store, tools,
                                      state.config.keepalive_seconds, audit,
                                      lambda: conversations.store)
    if not responses.stored_any():
        return
    models = request_models(state.config.limits)
    store, owner = responses.store, responses.owner
    for rid, previous in store.unfinished():
        if not owner.gone(previous) or not store.claim(rid, previous, owner.hold()):
            continue  # its server lives, or another server took it over first
        if previous is not None:
            owner.forget(previous)
        stored = store.get(None, rid)
        req = validate(models.responses, stored.settings)
        response = ResponseObject(req, rid, stored.response["created_at"])
        tenant = state.gateway.tenants.tenants.get(stored.tenant)
        try:
            if tenant is None:
                raise InvalidRequest(f"the tenant {stored.tenant!r} is gone")
            job = responses.runner.job(req, Principal(tenant), None, response,
                                       stored.input_items, stored.deadline_at)
        except InvalidRequest as exc:
            store.save(response.build("failed", [], error={"code": "server_error",
                                                          "message": str(exc)}))
            continue
        log.info("resuming the background run of %s", rid)
        _start(responses, job, store.last_event(rid) + 1)


def _server_tools(state: AppState) -> tuple:
    tools = () if state.serving.rag is None else (FileSearch(state.serving.rag),)
    if state.config.code_interpreter:
        code = CodeInterpreter(tenant_limits={
            name: t.code_interpreter for name, t in state.gateway.tenants.tenants.items()})
        if shutil.which(code.limits.command[0]) is None:  # a request naming it is then a 400
            log.error("--code-interpreter: the sandbox command %r is not installed; the tool "
                      "is not offered", code.limits.command[0])
        else:
            tools += (code,)
    if state.config.mcp_allowed_hosts:
        tools += (McpTools(McpLimits(tuple(h.lower() for h in state.config.mcp_allowed_hosts))),)
    return tools


# ---------------------------------------------------------------- GET, DELETE, cancel, items


def _stored(request: web.Request):
    stored = _responses(request).store.get(caller(request).tenant.name,
                                           request.match_info["response_id"])
    if stored is None:
        raise NotFound(f"No response found with id '{request.match_info['response_id']}'.",
                       param="response_id")
    return stored


def _query(request: web.Request, allowed: set[str]) -> dict[str, str]:
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0]!r}", param=unknown[0])
    return dict(request.query)


def _flag(query: dict, name: str) -> bool:
    value = query.get(name, "false")
    if value not in ("true", "false"):
        raise InvalidRequest(f"'{name}' must be true or false", param=name)
    return value == "true"


def _int(query: dict, name: str, default: int, low: int, high: int) -> int:
    text = query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be an integer in [{low}, {high}]", param=name)
    return value


async def retrieve(request: web.Request) -> web.StreamResponse:
    query = _query(request, {"stream", "starting_after", "include_obfuscation", "include"})
    stored = _stored(request)
    if not _flag(query, "stream"):
        if "starting_after" in query:
            raise InvalidRequest("'starting_after' needs stream=true", param="starting_after")
        return web.json_response(stored.response)
    if not (stored.background and stored.settings.get("stream")):
        raise InvalidRequest("only a response created with background and stream true can be "
                             "streamed again", param="stream")
    after = _int(query, "starting_after", -1, -1, 2**31)
    return await _follow(request, _responses(request), stored.id, after)


async def _follow(request: web.Request, responses: Responses, rid: str, after: int
                  ) -> web.StreamResponse:
    """The recorded events after `after`, then each new one as the run records it, to the
    run's last (or, when no run goes on here, to the last recorded)."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    state: AppState = request.app[STATE_KEY]
    store, runs = responses.store, responses.runs
    while True:
        changed = runs.changed(rid)
        running = runs.running(rid)
        events = store.events_after(rid, after)
        for event in events:
            await write_within(resp.write(sse(event, event["type"])),
                               state.config.stream_write_timeout_s)
            after = event["sequence_number"]
            if event["type"] in _TERMINAL:
                await resp.write_eof()
                return resp
        if events:
            continue
        if not running:
            break
        try:
            async with asyncio.timeout(state.config.keepalive_seconds):
                await changed.wait()
        except TimeoutError:
            await write_within(resp.write(b": keep-alive\n\n"),
                               state.config.stream_write_timeout_s)
    await resp.write_eof()
    return resp


_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


async def delete(request: web.Request) -> web.Response:
    stored = _stored(request)
    responses = _responses(request)
    await responses.runs.cancel(stored.id)
    responses.store.delete(stored.tenant, stored.id)
    return web.json_response({"id": stored.id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    stored = _stored(request)
    if not stored.background:
        raise InvalidRequest("only a response created with background true can be cancelled",
                             param="response_id")
    responses = _responses(request)
    if stored.status in UNFINISHED and not await responses.runs.cancel(stored.id):
        # Run by another server on this data directory, or left by a gone one: cancelled in
        # the store (its server's run ends at its next step, which finds it so).
        responses.store.save({**stored.response, "status": "cancelled"})
    return web.json_response(_stored(request).response)


async def input_items(request: web.Request) -> web.Response:
    query = _query(request, {"limit", "order", "after", "include"})
    stored = _stored(request)
    limit = _int(query, "limit", 20, 1, MAX_LIST)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be asc or desc", param="order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if "after" in query:
        ids = [item["id"] for item in items]
        if query["after"] not in ids:
            raise InvalidRequest(f"no input item {query['after']!r} in this response",
                                 param="after")
        items = items[ids.index(query["after"]) + 1:]
    page = items[:limit]
    return web.json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > limit})


def routes(models) -> list[Route]:
    gen = (400, 401, 404, 409, 422, 429, 500, 503, 504)
    one = "/v1/responses/{response_id}"
    return [
        Route("POST", "/v1/responses", create, "Response (OpenAI Responses API): stored unless "
              "store is false, chained by previous_response_id, or run in the background",
              models.responses, out.Response, chunk=out.ResponseEvent,
              errors=gen + (424,),  # an MCP server's tools could not be listed
              tags=("openai",)),
        Route("GET", one, retrieve, "A stored response; stream=true&starting_after=N replays "
              "a background run's stream and follows it", ok=out.Response,
              chunk=out.ResponseEvent, errors=(400, 401, 404), tags=("openai",)),
        Route("DELETE", one, delete, "Delete a stored response, its steps and events",
              ok=out.Deleted, errors=(401, 404), tags=("openai",)),
        Route("POST", one + "/cancel", cancel, "Cancel a background response",
              ok=out.Response, errors=(400, 401, 404), tags=("openai",)),
        Route("GET", one + "/input_items", input_items, "The input items of a stored response",
              ok=out.ItemList, errors=(400, 401, 404), tags=("openai",)),
        *conversation_routes.routes(),
    ]


def add_responses(app: web.Application, config: ServerConfig) -> None:
    """The app's stored responses (their routes are in the app's table), in the server's data
    directory."""
    from jaxserve.rag.config import default_data_dir

    data_dir = Path(config.data_dir or default_data_dir())
    app[RESPONSES_KEY] = Responses(StoreConfig(data_dir, config.response_ttl_s))
    app[CONVERSATIONS_KEY] = Conversations(data_dir)


def response_runner(app: web.Application) -> ResponseRunner:
    """The app's runner of POST /v1/responses (once the engine is attached), for the Batch API's
    /v1/responses lines (entrypoints/batch_lines.py) to take the same path."""
    return app[RESPONSES_KEY].runner


def close_responses(app: web.Application) -> None:
    responses = app.get(RESPONSES_KEY)
    if responses is not None:
        responses.close()
    conversations = app.get(CONVERSATIONS_KEY)
    if conversations is not None:
        conversations.close()

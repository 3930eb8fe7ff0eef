"""aiohttp OpenAI-compatible front end: chat and text completions (SSE streaming), responses
(server/responses_api.py), models, tokenize/detokenize, health/ready, Prometheus metrics, and GET
/openapi.json describing them all.

The handlers only translate: a body is read within the request limits (size, nesting, Unicode)
and validated by its request model, protocol.py turns it into engine requests, the AsyncEngine
generates, this module streams. A client that goes away (mid-stream or while waiting for a
non-streaming answer) cancels its handler — the server runs with handler cancellation on — and
the `finally` blocks abort its engine requests, so their KV pages return at once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import ssl
import time
from typing import Callable

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import (EngineOverloaded, InvalidRequest, JaxServeError, MethodNotAllowed,
                             NotFound, error_reply, error_status, outcome, retry_after)
from jaxserve.gateway import Gateway, Principal, deadlines, idempotency, load_tenants
from jaxserve.gateway.idempotency import IdempotencyStore
from jaxserve.gateway.limits import Lease, retry_after_header
from jaxserve.pricing import Pricing
from jaxserve.server import protocol
from jaxserve.server.admission import CallContext
from jaxserve.server import response_models as out
from jaxserve.server.json_body import LIMITS_KEY, parse_body, read_json
from jaxserve.server.metrics import CONTENT_TYPE, PolicyMetrics, ServerMetrics
from jaxserve.server.generation import Generation
from jaxserve.server.openai_serving import OpenAIServing
from jaxserve.server.openapi import ROUTES_KEY, Route, add_routes, openapi_document
from jaxserve.server.request_policy import RequestPolicy
from jaxserve.server.request_models import DetokenizeRequest, request_models
from jaxserve.server.responses_api import ResponseEvents, ResponseObject, chat_body, rename_param
from jaxserve.server.validation import validate

log = logging.getLogger("jaxserve.server")


class _State:
    """The app's state. The engine arrives after warmup: until then /health answers and /ready
    and the generation endpoints say the server is warming up."""

    def __init__(self, config: ServerConfig, model_name: str):
        self.config = config
        self.model_name = model_name
        # Read at build time: a bad tenants file is one error at start, naming file and field.
        self.gateway = Gateway(load_tenants(config.tenants_file) if config.tenants_file
                               else None)
        self.idempotency = IdempotencyStore(config.idempotency_ttl_s)
        self.serving: OpenAIServing | None = None
        self.metrics = ServerMetrics(self._stats, self._counters)
        # Read at build time too: a bad policy file or audit directory fails the start.
        self.policy = RequestPolicy.open(config.policy_file, config.audit_log_dir,
                                         PolicyMetrics(self.metrics.registry),
                                         self.gateway.tenants.tenants.values())
        self.shutting_down = False  # set on SIGTERM: not ready while in-flight requests drain
        self.openapi: dict | None = None  # built on first request, once every route is added

    def _stats(self) -> dict:
        if self.serving is None:  # warming up: no engine numbers yet
            return {}
        return {name: engine.replica_stats()
                for name, engine in self.serving.fleet.engines().items()}

    def _counters(self) -> dict:
        return {} if self.serving is None else self.serving.fleet.counters()

    def attach(self, engine, rag=None, pricing: Pricing | None = None, fleet=None) -> None:
        self.serving = OpenAIServing(engine, self.model_name, self.metrics,
                                     self.config.log_prompts, rag,
                                     self.config.max_queued_requests, self.config.limits,
                                     self.config.tool_call_parser, self.gateway, pricing, fleet,
                                     self.policy)

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise EngineOverloaded("the server is warming up; retry when GET /ready answers 200")
        return self.serving


STATE_KEY = web.AppKey("state", _State)
# Routes anyone may call (probes, scrapes, the API description); the admin API has its own key.
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
_PRINCIPAL = web.RequestKey("principal", Principal)  # who calls (set by _front_door)
_COUNTED = web.RequestKey("counted", bool)  # the request's end is counted (by its Generation)
# Routes each of whose requests gets one audit record (with --audit-log); from the call into
# OpenAIServing on, that record is the serving layer's, before it the front door's. A keyed
# caller's request the router refuses (no such path, or not with this method) gets one too.
_AUDITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_MAX_AUDITED_PATH = 256  # an unknown path is the caller's text: bounded in its record
_AUDITED = web.RequestKey("audited", bool)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


def caller(request: web.Request) -> Principal:
    """Who sent a request on a keyed route (set by the front door before any handler runs)."""
    return request[_PRINCIPAL]


_LEASE = web.RequestKey("lease", Lease)  # a limited call's hold on its tenant's limits


def tenant_limited(*, tokens: bool = False, holds_slot: bool = True):
    """A keyed route's handler under its tenant's limits, as generations are
    (`Gateway.admit_call`): a 429 with Retry-After before its body is read. `holds_slot`: work
    in an executor, one of max_concurrent_requests while it runs; `tokens`: it runs the encoder,
    whose tokens `charge_tokens` takes once they are known."""
    def wrap(handler):
        @functools.wraps(handler)
        async def limited(request: web.Request) -> web.StreamResponse:
            lease = request.app[STATE_KEY].gateway.admit_call(caller(request), tokens=tokens,
                                                               holds_slot=holds_slot)
            request[_LEASE] = lease
            try:
                return await handler(request)
            finally:
                lease.settle(0)  # does nothing once charge_tokens settled it
        return limited
    return wrap


def charge_tokens(request: web.Request, used_tokens: int) -> None:
    """A `tenant_limited(tokens=True)` call read `used_tokens` (its usage): settle with them."""
    request[_LEASE].settle(used_tokens)


def _error_status(exc: Exception) -> tuple[int, dict]:
    """Status and OpenAI error body of an exception (the table is jaxserve.errors'); a 500 is
    logged with its traceback."""
    if error_status(exc).http == 500:
        log.exception("request failed", exc_info=exc)
    return error_reply(exc)


def _map_error(exc: Exception) -> web.Response:
    status, body = _error_status(exc)
    wait = retry_after(exc)
    headers = {"Retry-After": retry_after_header(wait)} if wait is not None else {}
    if isinstance(exc, MethodNotAllowed):  # RFC 9110: a 405 says what the path allows
        headers["Allow"] = ",".join(exc.allowed)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except JaxServeError as exc:
        return _map_error(exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - one failing request must not take the server down
        return _map_error(exc)


@web.middleware
async def _unrouted(request: web.Request, handler):
    """The router's own refusals (no such path: 404; a path without this method: 405) as typed
    errors, so they are answered, counted and audited as every other error (OpenAI's words)."""
    refusal = request.match_info.http_exception
    if isinstance(refusal, web.HTTPMethodNotAllowed):
        raise MethodNotAllowed(f"Method not allowed ({request.method} {request.path}); allowed: "
                               f"{', '.join(sorted(refusal.allowed_methods))}",
                               tuple(sorted(refusal.allowed_methods)))
    if refusal is not None:
        raise NotFound(f"Invalid URL ({request.method} {request.path})")
    return await handler(request)


@web.middleware
async def _front_door(request: web.Request, handler):
    """Every route but the open ones needs the caller's key (401 `invalid_api_key`); each such
    request is counted per tenant by outcome (a generation counts itself when it ends). The
    open routes and the admin API (its own key) are neither: a 404 or 405 there is nobody's,
    and not audited (anyone could grow the log with them)."""
    if request.path in _OPEN_PATHS or request.path.startswith("/admin/"):
        return await handler(request)
    state: _State = request.app[STATE_KEY]
    tenant, principal, arrival = "none", None, time.monotonic()
    try:
        principal = state.gateway.authenticate(request.headers.get("Authorization"))
        request[_PRINCIPAL], tenant = principal, principal.tenant.name
        resp = await handler(request)
    except web.HTTPException:
        raise
    except BaseException as exc:
        if not request.get(_COUNTED):
            state.metrics.record_request(tenant, outcome(exc))
        unrouted = request.match_info.http_exception is not None and principal is not None
        if state.policy is not None and (request.path in _AUDITED_PATHS or unrouted) \
                and not request.get(_AUDITED):  # a 401, a body that is not JSON, a 409 ...
            state.policy.refused(CallContext(principal, arrival=arrival, client=request.remote,
                                             route=request.path[:_MAX_AUDITED_PATH]),
                                 exc, request.headers.get("Authorization"))
        raise
    if not request.get(_COUNTED):
        state.metrics.record_request(tenant, "ok")
    return resp


async def _ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* on every response to a known tenant, streams and errors too."""
    principal = request.get(_PRINCIPAL)
    if principal is not None:
        response.headers.update(request.app[STATE_KEY].gateway.headers(principal))


def _context(request: web.Request) -> CallContext:
    """Who calls and the deadline asked (X-Request-Timeout), read once from the headers."""
    return CallContext(request[_PRINCIPAL],
                       deadlines.parse_timeout(request.headers.get(deadlines.HEADER)),
                       client=request.remote, route=request.path)


async def _prepare(request: web.Request, serving: OpenAIServing, kind: str, body,
                   ctx: CallContext) -> Generation:
    request[_AUDITED] = True  # from here on the serving layer writes its audit record
    return await serving.prepare_async(kind, body, ctx)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: _State = request.app[STATE_KEY]
    ctx = _context(request)
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    serving = state.require_serving()
    body = await read_json(request)
    if key is None:
        return await _run(request, serving, kind, body, ctx, None)
    tenant = ctx.principal.tenant.name
    fingerprint = idempotency.fingerprint(request.path.encode() + b"\n" + await request.read())
    stored = state.idempotency.begin(tenant, key, fingerprint)
    if stored is not None:  # the model does not run again
        request[_AUDITED] = True
        if serving.policy is not None:
            serving.policy.record(request_id=protocol.new_id("replay"), kind=kind, ctx=ctx,
                                  error=None, model=body.get("model"), version=stored.version,
                                  idempotent_replay=True)
        return await _replay(request, stored)
    try:
        return await _run(request, serving, kind, body, ctx, functools.partial(
            state.idempotency.complete, tenant, key, fingerprint))
    finally:
        state.idempotency.abandon(tenant, key)  # unless completed: a retry then runs again


Keep = Callable[[idempotency.StoredResponse], None]


async def _run(request: web.Request, serving: OpenAIServing, kind: str, body,
               ctx: CallContext, keep: Keep | None) -> web.StreamResponse:
    gen = await _prepare(request, serving, kind, body, ctx)
    keepalive = request.app[STATE_KEY].config.keepalive_seconds
    return await _respond(request, gen, gen.response, lambda: _stream(
        request, gen, gen.chunks(keepalive), _error_event, keep=keep), keep)


async def _respond(request: web.Request, gen: Generation, whole, stream,
                   keep: Keep | None = None) -> web.StreamResponse:
    """Answer an admitted generation, `whole()` (a JSON body) or `stream()` (the streamed
    response), inside `gen.running()` (settled, counted, logged, its engine requests freed
    however it ends). `keep` (for an Idempotency-Key) receives what a replay sends once the
    request is answered in full: the body, or the SSE events (kept before the stream's end goes
    out: a client that closes right after [DONE] cancels this handler)."""
    request[_COUNTED] = True
    async with gen.running():
        if gen.parsed.stream:
            return await stream()
        resp = web.json_response(await whole())
        if keep is not None:
            keep(idempotency.StoredResponse(200, (("Content-Type", resp.content_type),),
                                            body=resp.body, version=gen.version.name))
        return resp


async def _replay(request: web.Request, stored: idempotency.StoredResponse) -> web.StreamResponse:
    headers = {**dict(stored.headers), "Idempotent-Replayed": "true"}
    if stored.body is not None:
        return web.Response(status=stored.status, body=stored.body, headers=headers)
    resp = web.StreamResponse(status=stored.status, headers={**_SSE_HEADERS, **headers})
    await resp.prepare(request)
    for event in stored.events:
        await resp.write(event)
    await resp.write_eof()
    return resp


def _sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {data}\n\n").encode()


def _error_event(exc: Exception) -> bytes:
    # As vLLM does: one error event (OpenAI clients raise it), then the usual end.
    return _sse(_error_status(exc)[1])


async def _stream(request: web.Request, gen: Generation, events, error_event, done: bool = True,
                  keep: Keep | None = None) -> web.StreamResponse:
    """The SSE response of `events` (JSON payloads, None for a keep-alive); an error reported in
    it is left in `gen.error`. A payload with a "type" is a named event (the Responses API's);
    `done`: end with `data: [DONE]` (chat and completions).

    The status line waits for the engine's first output (or the first keep-alive): a request
    refused while queued (deadline 504, shed 503, queue time 429) is then still a plain error
    reply. After it, an error is one error event."""
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    held: list[bytes] = []  # events before the engine answered (chat's role, echo, created)
    sent: list[bytes] = []  # what a replay sends (keep-alives left out)

    async def send(data: bytes) -> None:
        sent.append(data)
        await resp.write(data)  # drains the transport: each token leaves as it is produced

    try:
        async for payload in events:
            data = None if payload is None else _sse(payload, payload.get("type"))
            if not resp.prepared:
                if data is not None and not gen.engine_answered:
                    held.append(data)
                    continue
                await resp.prepare(request)
                for h in held:
                    await send(h)
            if data is None:
                await resp.write(b": keep-alive\n\n")
            else:
                await send(data)
    except ConnectionResetError:  # the client is gone: nobody to report to
        raise
    except Exception as exc:  # noqa: BLE001 - reported below
        if not resp.prepared:
            raise  # nothing sent yet: a plain error reply
        await resp.write(error_event(exc))
        gen.error = exc
    if not resp.prepared:
        await resp.prepare(request)
        for h in held:
            await send(h)
    end = [_sse("[DONE]")] if done else []
    if gen.error is None and keep is not None:  # kept before the end leaves (see _respond)
        keep(idempotency.StoredResponse(200, (("Content-Type", "text/event-stream"),),
                                        events=(*sent, *end), version=gen.version.name))
    for data in end:
        await resp.write(data)
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses over the chat path (server/responses_api.py)."""
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    req = validate(request_models(state.config.limits).responses, await read_json(request))
    try:
        gen = await _prepare(request, serving, "chat", chat_body(req), _context(request))
    except InvalidRequest as exc:
        raise rename_param(exc) from None
    response = ResponseObject(req)

    async def whole():
        return response.from_chat(await gen.response())

    events = ResponseEvents(response)

    def error_event(exc: Exception) -> bytes:
        event = events.error(_error_status(exc)[1])
        return _sse(event, event["type"])

    return await _respond(request, gen, whole, lambda: _stream(
        request, gen, events.events(gen.chunks(state.config.keepalive_seconds)), error_event,
        done=False))


async def models_route(request: web.Request) -> web.Response:
    """The routes (what most clients send as "model") and every ready version (addressable by
    name too); a version says its `system_fingerprint`, a route its versions and weights."""
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    tenant, created = request[_PRINCIPAL].tenant, protocol.now()
    routes, versions = serving.fleet.models()
    data = []
    for name in routes:
        route = serving.fleet.route(name)
        if route is not None:
            data.append({"id": name, "object": "model", "created": created,
                         "owned_by": "jaxserve", "route": {"weights": dict(route.weights),
                                                           "sticky": route.sticky}})
    for v in versions:
        data.append({"id": v.name, "object": "model", "created": created, "owned_by": "jaxserve",
                     "max_model_len": v.engine.max_model_len,
                     "system_fingerprint": v.fingerprint})
    # A model the tenant may not use does not exist for it.
    return web.json_response({"object": "list",
                              "data": [m for m in data if tenant.may_use(m["id"])]})


def _engine_for(request: web.Request, serving: OpenAIServing, model: str | None):
    """The engine whose tokenizer a tokenize / detokenize request means."""
    if model is None:
        if serving.engine is None:
            raise InvalidRequest("'model' is required: this server serves several models",
                                 param="model")
        return serving.engine
    request[_PRINCIPAL].tenant.check_model(model)
    return serving.engine_for(model)


@tenant_limited(holds_slot=False)  # answered on the event loop at once: no slot, no tokens
async def tokenize(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    body = await parse_body(request, request_models(state.config.limits).tokenize)
    engine = _engine_for(request, serving, body.model)
    tok = engine.tokenizer
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        ids = tok.encode(body.prompt, add_special_tokens=add_special)
    elif body.messages is not None:
        ids = tok.apply_chat_template(protocol.flatten_messages(body.messages),
                                      add_generation_prompt=True)
    else:
        raise InvalidRequest("give 'prompt' (a string) or 'messages' (a list)", param="prompt")
    return web.json_response({"tokens": list(ids), "count": len(ids),
                              "max_model_len": engine.max_model_len})


@tenant_limited(holds_slot=False)
async def detokenize(request: web.Request) -> web.Response:
    serving = request.app[STATE_KEY].require_serving()
    body = await parse_body(request, DetokenizeRequest)
    tok = _engine_for(request, serving, body.model).tokenizer
    serving.check_token_ids(tok, body.tokens, "tokens")
    return web.json_response({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    if state.shutting_down:
        return web.json_response({"status": "shutting down"}, status=503)
    if state.serving is None:
        return web.json_response({"status": "warming up"}, status=503)
    health = state.serving.fleet.health()
    return web.json_response({"status": health}, status=200 if health == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    if state.openapi is None:
        state.openapi = openapi_document(request.app[ROUTES_KEY], "jaxserve", _version())
    return web.json_response(state.openapi)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:
        return "0"


def _routes(config: ServerConfig) -> list[Route]:
    models = request_models(config.limits)
    gen = (400, 401, 404, 409, 422, 429, 500, 503, 504)
    return [
        Route("POST", "/v1/chat/completions", chat_completions, "Chat completion (OpenAI)",
              models.chat, out.ChatCompletion, chunk=out.ChatCompletionChunk, errors=gen,
              tags=("openai",)),
        Route("POST", "/v1/completions", completions, "Text completion (OpenAI)",
              models.completion, out.Completion, chunk=out.CompletionChunk, errors=gen,
              tags=("openai",)),
        Route("POST", "/v1/responses", responses, "Response (OpenAI Responses API; nothing "
              "stored)", models.responses, out.Response, chunk=out.ResponseEvent, errors=gen,
              tags=("openai",)),
        Route("GET", "/v1/models", models_route, "The served model", ok=out.ModelList,
              errors=(401, 503), tags=("openai",)),
        Route("POST", "/tokenize", tokenize, "Prompt or chat messages -> token ids",
              models.tokenize, out.Tokens, errors=(400, 401, 404, 429, 503), tags=("tokens",)),
        Route("POST", "/detokenize", detokenize, "Token ids -> text", DetokenizeRequest,
              out.Detokenized, errors=(400, 401, 404, 429, 503), tags=("tokens",)),
        Route("GET", "/health", health, "Alive (200 from the start, while warming up too)",
              ok=out.Status, tags=("operations",)),
        Route("GET", "/ready", ready, "Ready to generate: 200, else 503 with the reason",
              ok=out.Status, errors=(503,), tags=("operations",)),
        Route("GET", "/metrics", metrics, "Prometheus metrics", ok="text/plain",
              tags=("operations",)),
        Route("GET", "/openapi.json", openapi, "This description (OpenAPI 3.1)",
              tags=("operations",)),
    ]


def build_app(config: ServerConfig, model_name: str) -> web.Application:
    app = web.Application(middlewares=[_errors_middleware, _front_door, _unrouted],
                          client_max_size=config.limits.max_body_bytes)
    app[STATE_KEY] = _State(config, model_name)
    app.on_response_prepare.append(_ratelimit_headers)
    app[LIMITS_KEY] = config.limits
    add_routes(app, _routes(config))
    return app


def attach_engine(app: web.Application, engine, rag=None,
                  pricing: Pricing | None = None, fleet=None) -> None:
    """Start serving generations on `engine` (warmed up): /ready turns 200. With `rag` (a
    RagService), chat completions accept "rag"; with `pricing`, usage carries "cost". With
    `fleet` (a jaxserve.fleet.Fleet, serve --deployment), requests are served by its versions
    and `engine` is None."""
    app[STATE_KEY].attach(engine, rag, pricing, fleet)


def serving_of(app: web.Application) -> OpenAIServing:
    """The app's OpenAIServing (once attached), for the gRPC front end to share: one gateway
    (tenants, limits), one set of metrics, one access log."""
    return app[STATE_KEY].require_serving()


def begin_shutdown(app: web.Application) -> None:
    """/ready answers 503 from now on, so balancers stop sending while requests drain."""
    app[STATE_KEY].shutting_down = True


def close_app(app: web.Application) -> None:
    """After the last request: flush the audit log, stop the policy's classifiers."""
    policy = app[STATE_KEY].policy
    if policy is not None:
        policy.close()


async def start_server(app: web.Application, host: str, port: int,
                       ssl_context: ssl.SSLContext | None = None,
                       shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, int]:
    """Start listening (HTTPS with `ssl_context`); returns the runner (for cleanup) and the bound
    port (port 0 picks one). `runner.cleanup()` lets in-flight requests run up to
    `shutdown_timeout`, then cancels them."""
    # handler_cancellation: a client that disconnects cancels its handler, whose finally aborts
    # the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no accessor
    return runner, bound

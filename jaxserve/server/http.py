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
import json
import logging
import ssl

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import (EngineOverloaded, InvalidRequest, JaxServeError, error_reply,
                             error_status)
from jaxserve.server import protocol
from jaxserve.server import response_models as out
from jaxserve.server.json_body import LIMITS_KEY, parse_body, read_json
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.openai_serving import Generation, OpenAIServing
from jaxserve.server.openapi import ROUTES_KEY, Route, add_routes, openapi_document
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
        self.serving: OpenAIServing | None = None
        self.metrics = ServerMetrics(self._stats, model_name)
        self.shutting_down = False  # set on SIGTERM: not ready while in-flight requests drain
        self.openapi: dict | None = None  # built on first request, once every route is added

    def _stats(self):
        return None if self.serving is None else self.serving.engine.replica_stats()

    def attach(self, engine, rag=None) -> None:
        self.serving = OpenAIServing(engine, self.model_name, self.metrics,
                                     self.config.log_prompts, rag,
                                     self.config.max_queued_requests, self.config.limits,
                                     self.config.tool_call_parser)

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise EngineOverloaded("the server is warming up; retry when GET /ready answers 200")
        return self.serving


STATE_KEY = web.AppKey("state", _State)


def _error_status(exc: Exception) -> tuple[int, dict]:
    """Status and OpenAI error body of an exception (the table is jaxserve.errors'); a 500 is
    logged with its traceback."""
    if error_status(exc).http == 500:
        log.exception("request failed", exc_info=exc)
    return error_reply(exc)


def _map_error(exc: Exception) -> web.Response:
    status, body = _error_status(exc)
    return web.json_response(body, status=status)


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


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: _State = request.app[STATE_KEY]
    gen = await state.require_serving().prepare_async(kind, await read_json(request))
    keepalive = state.config.keepalive_seconds
    return await _respond(request, gen, gen.response,
                          lambda: _stream(request, gen.chunks(keepalive), _error_event))


async def _respond(request: web.Request, gen: Generation, whole, stream) -> web.StreamResponse:
    """Run a prepared generation to its answer, `whole()` (a JSON body) or `stream()` (the
    streamed response and how it ended), and whatever happens log it and free its engine
    requests."""
    status = "error"
    try:
        if gen.parsed.stream:
            resp, status = await stream()
        else:
            resp, status = web.json_response(await whole()), "ok"
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        status = "client_disconnected"
        raise
    finally:
        # Logged first: a client that closes right after [DONE] cancels the handler here, and the
        # await below would then raise before anything after it ran.
        gen.log_done(status)
        # Whatever ended the handler, the engine must not keep generating for nobody.
        await asyncio.shield(gen.abort_unfinished())


def _sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {data}\n\n").encode()


def _error_event(exc: Exception) -> bytes:
    # As vLLM does: one error event (OpenAI clients raise it), then the usual end.
    return _sse(_error_status(exc)[1])


async def _stream(request: web.Request, events, error_event, done: bool = True
                  ) -> tuple[web.StreamResponse, str]:
    """The SSE response of `events` (JSON payloads, None for a keep-alive) and how it ended
    ("ok" or "error"). A payload with a "type" is a named event (the Responses API's); `done`:
    end with `data: [DONE]` (chat and completions)."""
    status = "ok"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        async for payload in events:
            # resp.write drains the transport, so each token leaves as soon as it is produced.
            await resp.write(b": keep-alive\n\n" if payload is None
                             else _sse(payload, payload.get("type")))
    except ConnectionResetError:  # the client is gone: nobody to report to
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report it in the stream
        await resp.write(error_event(exc))
        status = "error"
    if done:
        await resp.write(_sse("[DONE]"))
    await resp.write_eof()
    return resp, status


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
        gen = await serving.prepare_async("chat", chat_body(req))
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
        request, events.events(gen.chunks(state.config.keepalive_seconds)), error_event,
        done=False))


async def models_route(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": protocol.now(),
        "owned_by": "jaxserve", "max_model_len": serving.engine.max_model_len}]})


async def tokenize(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    body = await parse_body(request, request_models(state.config.limits).tokenize)
    if body.model is not None:
        serving.check_model(body.model)
    tok = serving.tokenizer
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        ids = tok.encode(body.prompt, add_special_tokens=add_special)
    elif body.messages is not None:
        ids = tok.apply_chat_template(protocol.flatten_messages(body.messages),
                                      add_generation_prompt=True)
    else:
        raise InvalidRequest("give 'prompt' (a string) or 'messages' (a list)", param="prompt")
    return web.json_response({"tokens": list(ids), "count": len(ids),
                              "max_model_len": serving.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    serving = request.app[STATE_KEY].require_serving()
    body = await parse_body(request, DetokenizeRequest)
    if body.model is not None:
        serving.check_model(body.model)
    serving.check_token_ids(body.tokens, "tokens")
    return web.json_response({"prompt": serving.tokenizer.decode(body.tokens,
                                                                 skip_special_tokens=False)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    if state.shutting_down:
        return web.json_response({"status": "shutting down"}, status=503)
    if state.serving is None:
        return web.json_response({"status": "warming up"}, status=503)
    engine = state.serving.engine
    if not engine.is_running:  # the engine loop died: a balancer should move on
        return web.json_response({"status": "engine stopped"}, status=503)
    if engine.is_stalled:  # no step for --engine-stall-timeout while work waits
        return web.json_response({"status": "engine stalled"}, status=503)
    return web.json_response({"status": "ready"})


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
    gen = (400, 404, 500, 503)
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
              errors=(503,), tags=("openai",)),
        Route("POST", "/tokenize", tokenize, "Prompt or chat messages -> token ids",
              models.tokenize, out.Tokens, errors=(400, 404, 503), tags=("tokens",)),
        Route("POST", "/detokenize", detokenize, "Token ids -> text", DetokenizeRequest,
              out.Detokenized, errors=(400, 404, 503), tags=("tokens",)),
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
    app = web.Application(middlewares=[_errors_middleware],
                          client_max_size=config.limits.max_body_bytes)
    app[STATE_KEY] = _State(config, model_name)
    app[LIMITS_KEY] = config.limits
    add_routes(app, _routes(config))
    return app


def attach_engine(app: web.Application, engine, rag=None) -> None:
    """Start serving generations on `engine` (warmed up): /ready turns 200. With `rag` (a
    RagService), chat completions accept "rag"."""
    app[STATE_KEY].attach(engine, rag)


def begin_shutdown(app: web.Application) -> None:
    """/ready answers 503 from now on, so balancers stop sending while requests drain."""
    app[STATE_KEY].shutting_down = True


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

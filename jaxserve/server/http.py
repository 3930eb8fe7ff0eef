"""aiohttp OpenAI-compatible front end: chat and text completions (SSE streaming), models,
tokenize/detokenize, health/ready, Prometheus metrics.

The handlers only translate: protocol.py parses requests, the AsyncEngine generates, this module
streams. A client that goes away (mid-stream or while waiting for a non-streaming answer) cancels
its handler — the server runs with handler cancellation on — and the `finally` blocks abort its
engine requests, so their KV pages return at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Any

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import (AlreadyExists, ContextLengthExceeded, EngineDead, EngineOverloaded,
                             InvalidRequest, JaxServeError, ModelNotFound, NotFound)
from jaxserve.server import protocol
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.openai_serving import Generation, OpenAIServing

log = logging.getLogger("jaxserve.server")


class _State:
    """The app's state. The engine arrives after warmup: until then /health answers and /ready
    and the generation endpoints say the server is warming up."""

    def __init__(self, config: ServerConfig, model_name: str):
        self.config = config
        self.model_name = model_name
        self.serving: OpenAIServing | None = None
        self.metrics = ServerMetrics(self._stats, model_name)

    def _stats(self):
        return None if self.serving is None else self.serving.engine.replica_stats()

    def attach(self, engine, rag=None) -> None:
        self.serving = OpenAIServing(engine, self.model_name, self.metrics,
                                     self.config.log_prompts, rag,
                                     self.config.max_queued_requests)

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise EngineOverloaded("the server is warming up; retry when GET /ready answers 200")
        return self.serving


STATE_KEY = web.AppKey("state", _State)


def _error_status(exc: Exception) -> tuple[int, dict]:
    """The one place where typed errors become HTTP statuses and OpenAI error bodies."""
    if isinstance(exc, ModelNotFound):
        return 404, protocol.error_body(str(exc), "invalid_request_error", "model",
                                        "model_not_found")
    if isinstance(exc, NotFound):  # a RAG collection or document
        return 404, protocol.error_body(str(exc), "invalid_request_error", exc.param, "not_found")
    if isinstance(exc, AlreadyExists):
        return 409, protocol.error_body(str(exc), "invalid_request_error", exc.param,
                                        "already_exists")
    if isinstance(exc, ContextLengthExceeded):
        return 400, protocol.error_body(str(exc), "invalid_request_error", exc.param,
                                        "context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        return 400, protocol.error_body(str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, (EngineOverloaded, EngineDead)):
        return 503, protocol.error_body(str(exc), "server_error", code="overloaded")
    log.exception("request failed", exc_info=exc)
    return 500, protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")


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


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: _State = request.app[STATE_KEY]
    gen = await state.require_serving().prepare_async(kind, await _json_body(request))
    status = "error"
    try:
        if gen.parsed.stream:
            resp, status = await _stream(request, gen, state.config.keepalive_seconds)
        else:
            resp, status = web.json_response(await gen.response()), "ok"
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


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(request: web.Request, gen: Generation,
                  keepalive: float) -> tuple[web.StreamResponse, str]:
    """The SSE response and how it ended ("ok" or "error")."""
    status = "ok"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        async for chunk in gen.chunks(keepalive):
            # resp.write drains the transport, so each token leaves as soon as it is produced.
            await resp.write(b": keep-alive\n\n" if chunk is None else _sse(chunk))
    except ConnectionResetError:  # the client is gone: nobody to report to
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report it in the stream
        # As vLLM does: one error event (OpenAI clients raise it), then the usual end.
        await resp.write(_sse(_error_status(exc)[1]))
        status = "error"
    await resp.write(_sse("[DONE]"))
    await resp.write_eof()
    return resp, status


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def models(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    serving = state.require_serving()
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": protocol.now(),
        "owned_by": "jaxserve", "max_model_len": serving.engine.max_model_len}]})


async def _object_body(request: web.Request, serving: OpenAIServing) -> dict:
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if "model" in body:
        serving.check_model(body["model"])
    return body


async def tokenize(request: web.Request) -> web.Response:
    serving = request.app[STATE_KEY].require_serving()
    body = await _object_body(request, serving)
    tok = serving.tokenizer
    if isinstance(body.get("prompt"), str):
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidRequest("'add_special_tokens' must be a boolean",
                                 param="add_special_tokens")
        ids = tok.encode(body["prompt"], add_special_tokens=add_special)
    elif isinstance(body.get("messages"), list):
        parsed = protocol.parse_chat_request({"model": serving.model_name,
                                              "messages": body["messages"]})
        ids = tok.apply_chat_template(parsed.prompts[0], add_generation_prompt=True)
    else:
        raise InvalidRequest("give 'prompt' (a string) or 'messages' (a list)", param="prompt")
    return web.json_response({"tokens": list(ids), "count": len(ids),
                              "max_model_len": serving.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    serving = request.app[STATE_KEY].require_serving()
    body = await _object_body(request, serving)
    if not protocol.is_token_list(body.get("tokens")):
        raise InvalidRequest("'tokens' must be a list of token ids", param="tokens")
    serving.check_token_ids(body["tokens"], "tokens")
    return web.json_response({"prompt": serving.tokenizer.decode(body["tokens"],
                                                                 skip_special_tokens=False)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    if state.serving is None:
        return web.json_response({"status": "warming up"}, status=503)
    if not state.serving.engine.is_running:  # the engine loop died: a balancer should move on
        return web.json_response({"status": "engine stopped"}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    state: _State = request.app[STATE_KEY]
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def build_app(config: ServerConfig, model_name: str) -> web.Application:
    app = web.Application(middlewares=[_errors_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE_KEY] = _State(config, model_name)
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
    ])
    return app


def attach_engine(app: web.Application, engine, rag=None) -> None:
    """Start serving generations on `engine` (warmed up): /ready turns 200. With `rag` (a
    RagService), chat completions accept "rag"."""
    app[STATE_KEY].attach(engine, rag)


async def start_server(app: web.Application, host: str, port: int,
                       ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Start listening (HTTPS with `ssl_context`); returns the runner (for cleanup) and the bound
    port (port 0 picks one)."""
    # handler_cancellation: a client that disconnects cancels its handler, whose finally aborts
    # the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes no accessor
    return runner, bound

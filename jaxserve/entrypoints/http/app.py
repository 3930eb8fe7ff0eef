"""The aiohttp OpenAI-compatible server: its route table (the generation routes:
entrypoints/http/openai_routes.py; models, health/ready, Prometheus metrics,
and GET /openapi.json describing them all), the app built around the front door
(entrypoints/http/front_door.py), and starting, attaching the engine to, and stopping it.
"""

from __future__ import annotations

import hmac
import ssl

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import Forbidden, Unauthenticated
from jaxserve.gateway.pricing import Pricing
from jaxserve.entrypoints.serving import protocol
from jaxserve.entrypoints.serving import response_models as out
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.exposure import is_loopback
from jaxserve.entrypoints.http.front_door import MIDDLEWARES, caller, ratelimit_headers
from jaxserve.entrypoints.http import responses_routes
from jaxserve.entrypoints.http import anthropic_routes
from jaxserve.entrypoints.http import tokenizer_routes
from jaxserve.entrypoints.http.openai_routes import cache_header, chat_completions, completions
from jaxserve.entrypoints.http.json_body import LIMITS_KEY
from jaxserve.telemetry.metrics import CONTENT_TYPE
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.http.openapi import ROUTES_KEY, Route, add_routes, openapi_document
from jaxserve.entrypoints.serving.request_models import request_models


async def models_route(request: web.Request) -> web.Response:
    """The routes (what most clients send as "model") and every ready version (addressable by
    name too); a version says its `system_fingerprint`, a route its versions and weights."""
    state: AppState = request.app[STATE_KEY]
    serving = state.require_serving()
    tenant, created = caller(request).tenant, protocol.now()
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


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state: AppState = request.app[STATE_KEY]
    if state.shutting_down:
        return web.json_response({"status": "shutting down"}, status=503)
    if state.serving is None:
        return web.json_response({"status": "warming up"}, status=503)
    health = state.serving.fleet.health()
    return web.json_response({"status": health}, status=200 if health == "ready" else 503)


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus text. It names every tenant with its traffic, tokens and spend: with a
    metrics token only for `Authorization: Bearer TOKEN`; without one, a server with tenants
    answers loopback clients only (a scraper beside it, or a tunnel)."""
    state: AppState = request.app[STATE_KEY]
    token = state.config.metrics_token
    if token is not None:
        scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 token.encode()):
            raise Unauthenticated("/metrics needs 'Authorization: Bearer TOKEN', the token of "
                                  "--metrics-token-file")
    elif not state.gateway.tenants.open and not is_loopback(request.remote or ""):
        raise Forbidden("/metrics of a server with tenants answers loopback clients only, "
                        "unless the server has a metrics token (--metrics-token-file)")
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    state: AppState = request.app[STATE_KEY]
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
        *responses_routes.routes(models),
        *anthropic_routes.routes(config),
        Route("GET", "/v1/models", models_route, "The served model", ok=out.ModelList,
              errors=(401, 503), tags=("openai",)),
        *tokenizer_routes.routes(config),
        Route("GET", "/health", health, "Alive (200 from the start, while warming up too)",
              ok=out.Status, tags=("operations",)),
        Route("GET", "/ready", ready, "Ready to generate: 200, else 503 with the reason",
              ok=out.Status, errors=(503,), tags=("operations",)),
        Route("GET", "/metrics", metrics, "Prometheus metrics", ok="text/plain",
              errors=(401, 403), tags=("operations",)),
        Route("GET", "/openapi.json", openapi, "This description (OpenAPI 3.1)",
              tags=("operations",)),
    ]


def build_app(config: ServerConfig, model_name: str) -> web.Application:
    app = web.Application(middlewares=MIDDLEWARES,
                          client_max_size=config.limits.max_body_bytes)
    app[STATE_KEY] = AppState(config, model_name)
    app.on_response_prepare.append(ratelimit_headers)
    app.on_response_prepare.append(cache_header)
    app[LIMITS_KEY] = config.limits
    responses_routes.add_responses(app, config)
    add_routes(app, _routes(config))
    return app


def attach_engine(app: web.Application, engine, rag=None,
                  pricing: Pricing | None = None, fleet=None) -> None:
    """Start serving generations on `engine` (warmed up): /ready turns 200. With `rag` (a
    RagService), chat completions accept "rag"; with `pricing`, usage carries "cost". With
    `fleet` (a jaxserve.fleet.Fleet, serve --deployment), requests are served by its versions
    and `engine` is None."""
    app[STATE_KEY].attach(engine, rag, pricing, fleet)
    responses_routes.resume_runs(app)  # background runs a restart interrupted


def serving_of(app: web.Application) -> OpenAIServing:
    """The app's OpenAIServing (once attached), for the gRPC front end to share: one gateway
    (tenants, limits), one set of metrics, one access log."""
    return app[STATE_KEY].require_serving()


def begin_shutdown(app: web.Application) -> None:
    """/ready answers 503 from now on, so balancers stop sending while requests drain."""
    app[STATE_KEY].shutting_down = True


def close_app(app: web.Application) -> None:
    """After the last request: flush the audit log, stop the policy's classifiers, send the
    spans still queued."""
    state = app[STATE_KEY]
    responses_routes.close_responses(app)
    if state.policy is not None:
        state.policy.close()
    if state.tracing is not None:
        state.tracing.shutdown()


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

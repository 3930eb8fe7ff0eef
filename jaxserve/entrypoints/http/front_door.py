"""The HTTP front door, in front of every handler: who calls (the tenant's key: 401), the
router's own refusals (404, 405) and every typed error as OpenAI's error body (the one table in
jaxserve.errors, with Retry-After and Allow), each keyed request's one `Call` (calls.py), which
the front door ends unless the serving layer did; OpenAI's x-ratelimit-* on every response to a
known tenant; and the tenant's limits on the routes beside generation (`tenant_limited`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging

from aiohttp import web

from jaxserve.errors import (JaxServeError, MethodNotAllowed, NotFound, anthropic_error_body,
                             error_reply, error_status, retry_after)
from jaxserve.gateway import Principal, deadlines
from jaxserve.gateway.limits import Lease, retry_after_header
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.calls import Call
from jaxserve.entrypoints.serving.outcome import call_outcome
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.exposure import open_server_guard

log = logging.getLogger("jaxserve.server")

# Routes anyone may call (probes, scrapes, the API description); the admin API has its own key.
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json"})
_PRINCIPAL = web.RequestKey("principal", Principal)  # who calls (set by _front_door)
_CALL = web.RequestKey("call", Call)  # the keyed request's one end (set by _front_door)
# Every keyed request gets one audit record (with --audit-log). Not /v1/models: clients poll it
# as a health check (it is not rate-limited either), and it reads nothing of a tenant's. A
# request the router refuses (no such path, or not with this method) is recorded for a known
# tenant only, so keyless scanners cannot grow the log.
_UNAUDITED_PATHS = frozenset({"/v1/models"})
_MAX_AUDITED_PATH = 256  # a path is the caller's text: bounded in its record
_USED_TOKENS = web.RequestKey("used_tokens", int)  # an encoder call's tokens (its usage)
# Anthropic's Messages API routes answer errors in Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"


def caller(request: web.Request) -> Principal:
    """Who sent a request on a keyed route (set by the front door before any handler runs)."""
    return request[_PRINCIPAL]


def call_of(request: web.Request) -> Call:
    """A keyed request's call, for the serving layer to end (a refusal, a Generation) or a
    route to end itself (an idempotent replay); else the front door ends it."""
    return request[_CALL]


_LEASE = web.RequestKey("lease", Lease)  # a limited call's hold on its tenant's limits


def tenant_limited(*, tokens: bool = False, holds_slot: bool = True):
    """A keyed route's handler under its tenant's limits, as generations are
    (`Gateway.admit_call`): a 429 with Retry-After before its body is read; the hold settles
    when the call ends (the front door). `holds_slot`: work in an executor, one of
    max_concurrent_requests while it runs; `tokens`: it runs the encoder, whose tokens
    `charge_tokens` names once they are known."""
    def wrap(handler):
        @functools.wraps(handler)
        async def limited(request: web.Request) -> web.StreamResponse:
            state: AppState = request.app[STATE_KEY]
            if state.policy is not None:  # a call whose record the log cannot take: 503
                state.policy.check_accepting()
            lease = state.gateway.admit_call(caller(request), tokens=tokens,
                                             holds_slot=holds_slot)
            request[_LEASE] = lease
            return await handler(request)
        return limited
    return wrap


def lease_of(request: web.Request) -> Lease | None:
    """A `tenant_limited` call's hold on its tenant's limits (for work it runs off the loop,
    which the hold waits for: serving.offload)."""
    return request.get(_LEASE)


def charge_tokens(request: web.Request, used_tokens: int) -> None:
    """A `tenant_limited(tokens=True)` call read `used_tokens` (its usage): its end settles with
    them (and its audit record's `prompt_tokens` names them)."""
    request[_USED_TOKENS] = used_tokens


def logged_error_reply(exc: Exception) -> tuple[int, dict]:
    """Status and OpenAI error body of an exception (the table is jaxserve.errors'); a 500 is
    logged with its traceback."""
    if error_status(exc).http == 500:
        log.exception("request failed", exc_info=exc)
    return error_reply(exc)


def _map_error(request: web.Request, exc: Exception) -> web.Response:
    status, body = logged_error_reply(exc)
    if request.path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(status, body)
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
        return _map_error(request, exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - one failing request must not take the server down
        return _map_error(request, exc)


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
    request is one call, ended once (counted per tenant by outcome, audited): by the serving
    layer or its Generation, else here. The open routes and the admin API (its own key) are
    neither: a 404 or 405 there is nobody's. (vLLM's /sleep, /wake_up and /is_sleeping are admin
    routes outside /admin/: their handlers say so.)"""
    if request.path in _OPEN_PATHS or request.path.startswith("/admin/") or getattr(
            request.match_info.handler, "admin_only", False):
        return await handler(request)
    state: AppState = request.app[STATE_KEY]
    call = request[_CALL] = Call(state.sinks)
    ctx = CallContext(None, client=request.remote, route=request.path[:_MAX_AUDITED_PATH])
    try:
        principal = state.gateway.authenticate(authorization(request), request.remote or "")
        request[_PRINCIPAL] = principal
        ctx = dataclasses.replace(ctx, principal=principal)
        if state.policy is not None and request.path not in _UNAUDITED_PATHS:
            state.policy.check_accepting()  # no audited call the log cannot take: 503
        resp = await handler(request)
    except web.HTTPException:
        raise
    except BaseException as exc:
        _end(request, call, ctx, exc)
        raise
    _end(request, call, ctx, None, resp.status)
    return resp


def authorization(request: web.Request) -> str | None:
    """The caller's credentials: the Authorization header, or else Anthropic's x-api-key (its
    clients' way of sending the same key) as a bearer token."""
    auth = request.headers.get("Authorization")
    if auth is None and "x-api-key" in request.headers:
        return f"Bearer {request.headers['x-api-key']}"
    return auth


def _end(request: web.Request, call: Call, ctx: CallContext, error: BaseException | None,
         status_code: int = 200) -> None:
    """End the call with what the front door knows, unless the serving layer ended it."""
    if call.ended:
        return
    routed = request.match_info.http_exception is None
    call.end(call_outcome(ctx, error, authorization=authorization(request),
                          prompt_tokens=request.get(_USED_TOKENS, 0), success_code=status_code,
                          audited=request.path not in _UNAUDITED_PATHS
                          and (routed or ctx.principal is not None)),
             tenant_hold=request.get(_LEASE))


async def ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* on every response to a known tenant, streams and errors too."""
    principal = request.get(_PRINCIPAL)
    if principal is not None:
        response.headers.update(request.app[STATE_KEY].gateway.headers(principal))


def call_context(request: web.Request) -> CallContext:
    """Who calls, the deadline asked (X-Request-Timeout) and the caller's trace context (W3C
    traceparent), read once from the headers."""
    ctx = CallContext(request[_PRINCIPAL],
                      deadlines.parse_timeout(request.headers.get(deadlines.HEADER)),
                      client=request.remote, route=request.path)
    tracing = request.app[STATE_KEY].tracing
    if tracing is not None:  # the caller's traceparent, if any, is its span's parent
        ctx = dataclasses.replace(ctx, trace=tracing.start(request.headers, ctx.arrival))
    return ctx


# Outermost first: errors become replies around everything, an open server's Host and Origin
# are checked before anything runs (exposure.py), the key is checked before the router's refusal
# is raised (so a caller without a key learns nothing about the paths).
MIDDLEWARES = (_errors_middleware, open_server_guard, _front_door, _unrouted)

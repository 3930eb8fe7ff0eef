"""The admin API: model versions and routes of a Fleet, changed while traffic flows.

`add_admin_routes(app, fleet, admin_key)` registers (before the server starts; `fleet` may
follow with `set_admin_fleet` once it is loaded, and until then the routes answer 503), on the app
built by `jaxserve.entrypoints.http.app.build_app` (whose middleware turns typed errors into OpenAI
error bodies):

    GET    /admin/v1/versions                 versions: state, manifest, memory, counters
    GET    /admin/v1/versions/{name}
    POST   /admin/v1/versions                 {"name", "model", ...engine flags} -> 202, loading
    DELETE /admin/v1/versions/{name}          drain, then unload -> 202 (409 while routed to)
    GET    /admin/v1/routes                   routes: weights, sticky, shadow, canary, breaker,
                                              counters
    PUT    /admin/v1/routes/{route}           {"weights"?, "sticky"?, "shadow"?, "canary"?,
                                               "breaker"?}
    POST   /admin/v1/routes/{route}/rollback  the previous settings
    GET    /admin/v1/audit/head               the audit log's head: {"seq", "hash", "keyed"}
    POST   /sleep?level=1|2&model=V&timeout=S  vLLM's: free V's KV cache (2: and move its weights
                                              to host memory) once its requests end
    POST   /wake_up?model=V&tags=T            bring back what tags name (weights, kv_cache; all)
    GET    /is_sleeping?model=V               {"is_sleeping", "model", "state", "sleeping"}

`model` names a version; it may be left out when the fleet has one.

Every route needs `Authorization: Bearer KEY` (compared in constant time): 401 otherwise, and a
client whose keys failed too often is refused (429) before its key is checked (the server's
AuthThrottle, shared with the tenants' keys). With --audit-log every call with the key is an
`admin` record (method, path, status, the key's id, the client, the body), and every refusal is
counted in its client's `refusals` summary; a route under /admin/ that is not `admin_only` fails
the start. Calls that read files (a version's metadata) run in the executor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import hmac
import os
from pathlib import Path
from typing import Sequence

from aiohttp import web

from jaxserve.audit import AdminRecord
from jaxserve.audit.record import admin_body
from jaxserve.errors import (ConfigError, EngineOverloaded, InvalidRequest, JaxServeError,
                             NotFound, TokenizerError, Unauthenticated, WeightsError, error_body,
                             error_status, outcome)
from jaxserve.gateway.keys import key_id, presented_key_id
from jaxserve.fleet.deployment import confine_admin_paths, parse_route, parse_version
from jaxserve.fleet.fleet import Fleet
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.entrypoints.http.json_body import read_object
from jaxserve.entrypoints.http.openapi import Route, add_routes

class _FleetRef:
    """The fleet the admin routes act on: registered before the server starts (aiohttp's router
    freezes then), filled in once the fleet has loaded."""

    def __init__(self, fleet: Fleet | None):
        self.fleet = fleet


FLEET_KEY = web.AppKey("admin_fleet", _FleetRef)
_KEY_DIGEST = web.AppKey("admin_key_digest", bytes)
_MODEL_ROOTS = web.AppKey("admin_model_roots", object)  # where the admin may load models from
# The admin API's own reading of errors that elsewhere are the server's (a model it cannot load is
# the caller's 400 here); the rest (400 InvalidRequest, 404 NotFound / ModelNotFound, 409
# AlreadyExists / Conflict / InsufficientMemory) go through the app's error middleware and the
# one table in jaxserve.errors, like every other route's.
_STATUS = {WeightsError: (400, "invalid_model"), TokenizerError: (400, "invalid_model"),
           ConfigError: (400, "invalid_model")}


def _fleet(request: web.Request) -> Fleet:
    fleet = request.app[FLEET_KEY].fleet
    if fleet is None:
        raise EngineOverloaded("the server is warming up; retry when GET /ready answers 200")
    return fleet


ADMIN_KEY_ENV = "JAXSERVE_ADMIN_KEY"


def admin_key(args: argparse.Namespace) -> str | None:
    """The admin key of `serve`: --admin-key-file's text (stripped), else --admin-key (seen by
    every local user in the process list), else $JAXSERVE_ADMIN_KEY; None: no admin API."""
    if args.admin_key is not None and args.admin_key_file is not None:
        raise ConfigError("give one of --admin-key and --admin-key-file")
    if args.admin_key_file is not None:
        try:
            key = args.admin_key_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"--admin-key-file {args.admin_key_file}: {e.strerror}") from None
        if not key:
            raise ConfigError(f"--admin-key-file {args.admin_key_file}: the file is empty")
        return key
    if args.admin_key is not None:
        return args.admin_key
    return os.environ.get(ADMIN_KEY_ENV) or None


def _digest(key: str) -> bytes:
    # Comparing digests keeps the comparison constant-time whatever the key's length.
    return hashlib.sha256(key.encode()).digest()


def _authorized(request: web.Request) -> bool:
    expected = request.app.get(_KEY_DIGEST)  # None: no admin key, so no admin
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return expected is not None and scheme.lower() == "bearer" and hmac.compare_digest(
        _digest(token.strip()), expected)


def _audit(request: web.Request):
    """The server's audit log, or None (no --audit-log, or an app without the server's state)."""
    state = request.app.get(STATE_KEY)
    policy = state.policy if state is not None else None
    return policy.audit if policy is not None else None


def _refused(request: web.Request, exc: JaxServeError) -> None:
    """A refused admin call: nobody's, so counted in its client's summary (audit/refusals.py)."""
    audit = _audit(request)
    if audit is not None:
        audit.count_refusal(request.remote, None, outcome(exc), request.path[:256],
                            presented_key_id(request.headers.get("Authorization")))


async def _record(request: web.Request, error: BaseException | None, status: int | None) -> None:
    audit = _audit(request)
    if audit is None:
        return
    data = b""
    if request.body_exists:
        try:
            data = await request.read()  # the handler's read is cached: the same bytes
        except web.HTTPException:  # over the server's body limit: not kept
            data = b""
    body, digest = admin_body(data)
    audit.write(AdminRecord(request.method, request.path, outcome(error), status,
                            key_id(request.app[_KEY_DIGEST]), request.remote, body, digest))


def admin_only(handler):
    """The handler behind the admin key (401 without it, or when no --admin-key was set; 429
    while the client is over its failed keys), each call audited (see the module)."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.app.get(STATE_KEY)
        throttle = state.gateway.auth_throttle if state is not None else None
        try:
            if throttle is not None:
                throttle.check(request.remote or "")
        except JaxServeError as exc:
            _refused(request, exc)
            raise
        if not _authorized(request):
            if throttle is not None:
                throttle.failed(request.remote or "")
            _refused(request, Unauthenticated("wrong admin key"))
            return web.json_response(
                error_body("the admin API needs 'Authorization: Bearer <admin key>'",
                           "invalid_request_error", code="invalid_api_key"),
                status=401, headers={"WWW-Authenticate": "Bearer"})
        error, status = None, None
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except tuple(_STATUS) as exc:
            error = exc
            status, code = next(v for t, v in _STATUS.items() if isinstance(exc, t))
            return web.json_response(error_body(str(exc), "invalid_request_error",
                                                getattr(exc, "param", None), code),
                                     status=status)
        except JaxServeError as exc:
            error, status = exc, error_status(exc).http
            raise
        except BaseException as exc:  # a 500, or the client left (no status)
            error = exc
            status = None if outcome(exc) == "client_disconnected" else 500
            raise
        finally:
            await _record(request, error, status)
    wrapped.admin_only = True
    return wrapped


async def _in_executor(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


@admin_only
async def list_versions(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _fleet(request).versions_info()})


@admin_only
async def get_version(request: web.Request) -> web.Response:
    return web.json_response(_fleet(request).version_info(request.match_info["name"]))


@admin_only
async def load_version(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    body = await read_object(request)
    if "name" not in body:
        raise InvalidRequest("'name' is required", param="name")
    name = body.pop("name")
    spec = parse_version(name, body)
    confine_admin_paths(spec, request.app[_MODEL_ROOTS])
    version = await _in_executor(fleet.load, spec)
    return web.json_response(fleet.version_info(version.name), status=202,
                             headers={"Location": f"/admin/v1/versions/{version.name}"})


@admin_only
async def unload_version(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    version = fleet.unload(request.match_info["name"])
    return web.json_response(fleet.version_info(version.name), status=202)


@admin_only
async def list_routes(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _fleet(request).routes_info()})


@admin_only
async def put_route(request: web.Request) -> web.Response:
    fleet, name = _fleet(request), request.match_info["route"]
    route = fleet.set_route(parse_route(name, await read_object(request), base=fleet.route(name)))
    return web.json_response(fleet.route_info(route.name))


@admin_only
async def rollback_route(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    route = fleet.rollback(request.match_info["route"])
    return web.json_response(fleet.route_info(route.name))


# POST /sleep waits at most this long for the version's requests in flight (the `timeout` query
# parameter, default SLEEP_TIMEOUT_S).
SLEEP_TIMEOUT_S, MAX_SLEEP_TIMEOUT_S = 30.0, 600.0


def _query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The query parameters, each a list of its values; one not in `allowed` is a 400."""
    params: dict[str, list[str]] = {}
    for key, value in request.query.items():
        if key not in allowed:
            raise InvalidRequest(f"unknown query parameter {key!r} (this route takes "
                                 f"{', '.join(allowed)})", param=key)
        params.setdefault(key, []).append(value)
    return params


def _one(params: dict[str, list[str]], key: str) -> str | None:
    values = params.get(key)
    if values is not None and len(values) > 1:
        raise InvalidRequest(f"give {key!r} once", param=key)
    return values[0] if values else None


def _sleep_target(fleet: Fleet, params: dict[str, list[str]]) -> str:
    """The version `model` names, or the fleet's only live one."""
    name = _one(params, "model")
    if name is not None:
        return name
    live = [v["name"] for v in fleet.versions_info() if v["state"] in ("ready", "sleeping")]
    if len(live) != 1:
        raise InvalidRequest(f"name the version with ?model= (this server has {len(live)})",
                             param="model")
    return live[0]


def _sleep_state(fleet: Fleet, name: str) -> dict:
    info = fleet.version_info(name)
    return {"model": name, "is_sleeping": info["state"] == "sleeping", "state": info["state"],
            "sleeping": info["sleeping"]}


@admin_only
async def sleep(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    params = _query(request, ("level", "model", "timeout"))
    level = _one(params, "level") or "1"
    if level not in ("1", "2"):
        raise InvalidRequest(f"level is 1 (free the KV cache) or 2 (also move the weights to "
                             f"host memory), got {level[:16]!r}", param="level")
    try:
        timeout = float(_one(params, "timeout") or SLEEP_TIMEOUT_S)
    except ValueError:
        timeout = -1.0
    if not 0 <= timeout <= MAX_SLEEP_TIMEOUT_S:  # NaN fails too
        raise InvalidRequest(f"timeout is seconds in [0, {MAX_SLEEP_TIMEOUT_S:g}]",
                             param="timeout")
    name = _sleep_target(fleet, params)
    await _in_executor(fleet.sleep, name, int(level), timeout)
    return web.json_response(_sleep_state(fleet, name))


@admin_only
async def wake_up(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    params = _query(request, ("model", "tags"))
    tags = params.get("tags")
    if tags is not None and not set(tags) <= {"weights", "kv_cache"}:
        raise InvalidRequest("tags are weights and kv_cache", param="tags")
    name = _sleep_target(fleet, params)
    await _in_executor(fleet.wake_up, name, tags)
    return web.json_response(_sleep_state(fleet, name))


@admin_only
async def is_sleeping(request: web.Request) -> web.Response:
    fleet = _fleet(request)
    return web.json_response(_sleep_state(fleet, _sleep_target(fleet, _query(request,
                                                                             ("model",)))))


@admin_only
async def audit_head(request: web.Request) -> web.Response:
    audit = _audit(request)
    if audit is None:
        raise NotFound("this server keeps no audit log (serve --audit-log DIR)")
    head = audit.head
    return web.json_response({"seq": head[0] if head else None,
                              "hash": head[1] if head else None,
                              "keyed": audit.config.key is not None})


async def _check_guarded(app: web.Application) -> None:
    """Defence in depth: no route under /admin/ may skip the admin key (`admin_only`)."""
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/admin/") and not getattr(route.handler, "admin_only", False):
            raise ConfigError(f"{route.method} {path} is not behind the admin key "
                              f"(admin_only)")


def add_admin_routes(app: web.Application, fleet: Fleet | None, admin_key: str,
                     model_roots: Sequence[Path] | None = None) -> None:
    """Serve the admin API for `fleet` (None: set later with `set_admin_fleet`), guarded by
    `admin_key`; models it loads by path must lie under `model_roots` (None: the model cache;
    fleet.deployment.confine_admin_paths). Call before the server starts."""
    if not admin_key:
        raise ConfigError("the admin key must not be empty")
    app[FLEET_KEY] = _FleetRef(fleet)
    app[_KEY_DIGEST] = _digest(admin_key)
    app[_MODEL_ROOTS] = tuple(model_roots) if model_roots is not None else None
    # Described in /openapi.json without body or answer schemas: the fleet parses these bodies
    # itself (jaxserve.fleet.deployment), with no request model to publish yet.
    errors, tags = (400, 401, 404, 409, 503), ("admin",)
    add_routes(app, [
        Route("GET", "/admin/v1/versions", list_versions, "Model versions", errors=errors,
              tags=tags),
        Route("POST", "/admin/v1/versions", load_version, "Load a version", ok_status=202,
              errors=errors, tags=tags),
        Route("GET", "/admin/v1/versions/{name}", get_version, "One version", errors=errors,
              tags=tags),
        Route("DELETE", "/admin/v1/versions/{name}", unload_version, "Drain, then unload",
              ok_status=202, errors=errors, tags=tags),
        Route("GET", "/admin/v1/routes", list_routes, "Routes", errors=errors, tags=tags),
        Route("PUT", "/admin/v1/routes/{route}", put_route, "Change a route", errors=errors,
              tags=tags),
        Route("POST", "/admin/v1/routes/{route}/rollback", rollback_route,
              "Back to the previous settings", errors=errors, tags=tags),
        Route("GET", "/admin/v1/audit/head", audit_head,
              "The audit log's head (seq, hash), for `jaxserve audit verify --head`",
              errors=(401, 404, 429), tags=tags),
        Route("POST", "/sleep", sleep, "Put a version to sleep (vLLM's sleep mode)",
              errors=errors, tags=tags),
        Route("POST", "/wake_up", wake_up, "Wake a sleeping version", errors=errors,
              tags=tags),
        Route("GET", "/is_sleeping", is_sleeping, "Whether a version sleeps", errors=errors,
              tags=tags),
    ])
    app.on_startup.append(_check_guarded)


def set_admin_fleet(app: web.Application, fleet: Fleet) -> None:
    """The fleet the admin routes act on, once it is loaded (the routes were added before)."""
    app[FLEET_KEY].fleet = fleet

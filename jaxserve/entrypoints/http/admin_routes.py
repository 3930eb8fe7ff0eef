"""The admin API: model versions and routes of a Fleet, changed while traffic flows.

`add_admin_routes(app, fleet, admin_key)` registers (before the server starts; `fleet` may
follow with `set_admin_fleet` once it is loaded, and until then the routes answer 503), on the app
built by `jaxserve.entrypoints.http.app.build_app` (whose middleware turns typed errors into OpenAI
error bodies):

    GET    /admin/v1/versions                 versions: state, manifest, memory, counters
    GET    /admin/v1/versions/{name}
    POST   /admin/v1/versions                 {"name", "model", ...engine flags} -> 202, loading
    DELETE /admin/v1/versions/{name}          drain, then unload -> 202 (409 while routed to)
    GET    /admin/v1/routes                   routes: weights, sticky, shadow, canary, counters
    PUT    /admin/v1/routes/{route}           {"weights"?, "sticky"?, "shadow"?, "canary"?}
    POST   /admin/v1/routes/{route}/rollback  the previous settings

Every route needs `Authorization: Bearer KEY` (compared in constant time): 401 otherwise. Calls
that read files (a version's metadata) run in the executor.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac

from aiohttp import web

from jaxserve.errors import (ConfigError, EngineOverloaded, InvalidRequest, TokenizerError,
                             WeightsError, error_body)
from jaxserve.fleet.deployment import parse_route, parse_version
from jaxserve.fleet.fleet import Fleet
from jaxserve.entrypoints.http.json_body import read_object
from jaxserve.entrypoints.http.openapi import Route, add_routes

class _FleetRef:
    """The fleet the admin routes act on: registered before the server starts (aiohttp's router
    freezes then), filled in once the fleet has loaded."""

    def __init__(self, fleet: Fleet | None):
        self.fleet = fleet


FLEET_KEY = web.AppKey("admin_fleet", _FleetRef)
_KEY_DIGEST = web.AppKey("admin_key_digest", bytes)
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


def _digest(key: str) -> bytes:
    # Comparing digests keeps the comparison constant-time whatever the key's length.
    return hashlib.sha256(key.encode()).digest()


def _authorized(request: web.Request) -> bool:
    expected = request.app.get(_KEY_DIGEST)  # None: no admin key, so no admin
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return expected is not None and scheme.lower() == "bearer" and hmac.compare_digest(
        _digest(token.strip()), expected)


def admin_only(handler):
    """The handler behind the admin key (401 without it, or when no --admin-key was set)."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        if not _authorized(request):
            return web.json_response(
                error_body("the admin API needs 'Authorization: Bearer <admin key>'",
                           "invalid_request_error", code="invalid_api_key"),
                status=401, headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except tuple(_STATUS) as exc:
            status, code = next(v for t, v in _STATUS.items() if isinstance(exc, t))
            return web.json_response(error_body(str(exc), "invalid_request_error",
                                                getattr(exc, "param", None), code),
                                     status=status)
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


def add_admin_routes(app: web.Application, fleet: Fleet | None, admin_key: str) -> None:
    """Serve the admin API for `fleet` (None: set later with `set_admin_fleet`), guarded by
    `admin_key`; call before the server starts."""
    if not admin_key:
        raise ConfigError("the admin key must not be empty")
    app[FLEET_KEY] = _FleetRef(fleet)
    app[_KEY_DIGEST] = _digest(admin_key)
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
    ])


def set_admin_fleet(app: web.Application, fleet: Fleet) -> None:
    """The fleet the admin routes act on, once it is loaded (the routes were added before)."""
    app[FLEET_KEY].fleet = fleet

"""Routes declared once: each `Route` registers its aiohttp handler and describes itself in the
OpenAPI 3.1 document served at GET /openapi.json, with the request model the handler parses and
the models of its answers. A route cannot be served without being described."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxserve.entrypoints.serving.response_models import ErrorResponse

ROUTES_KEY = web.AppKey("routes", list)
_REF = "#/components/schemas/{model}"
_DESCRIPTIONS = {200: "OK", 201: "Created", 202: "Accepted (it goes on in the background)",
                 400: "Invalid request (the `param` names the field)",
                 401: "Missing or wrong credentials",
                 403: "Not from here: a Host or Origin an open server does not answer, or "
                      "/metrics to a client it is not open to",
                 404: "Unknown model or resource",
                 409: "Conflicts with the current state (or the same Idempotency-Key still runs)",
                 415: "The body is not sent as JSON (Content-Type: application/json)",
                 422: "Idempotency-Key reused with a different body",
                 424: "A service the request names failed (a remote MCP server's tools could "
                      "not be listed)",
                 429: "A rate limit of the tenant, or too many failed keys from this address "
                      "(Retry-After says when to retry)",
                 500: "The request failed inside the server",
                 503: "Not ready or overloaded (Retry-After)",
                 504: "The request's deadline passed before it could be answered"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # aiohttp's: "/v1/collections/{name}"
    handler: Callable
    summary: str
    body: type[BaseModel] | None = None  # the model the handler validates its JSON body with
    ok: type[BaseModel] | str | None = None  # JSON answer model, or a media type ("text/plain")
    ok_status: int = 200
    # `stream: true` answers text/event-stream: `data:` events each holding one of these (or
    # an error body), then `data: [DONE]`
    chunk: type[BaseModel] | None = None
    errors: tuple[int, ...] = ()
    tags: tuple[str, ...] = field(default=())
    error_body: type[BaseModel] = ErrorResponse  # the shape of its error answers


def add_routes(app: web.Application, routes: list[Route]) -> None:
    """Register `routes` on `app` (before it starts) and list them for /openapi.json."""
    app.setdefault(ROUTES_KEY, []).extend(routes)
    for r in routes:
        app.router.add_route(r.method, r.path, r.handler)


def _models(routes: list[Route]) -> list[tuple[type[BaseModel], str]]:
    keys = [(r.body, "validation") for r in routes if r.body is not None]
    keys += [(r.ok, "serialization") for r in routes if isinstance(r.ok, type)]
    keys += [(r.chunk, "serialization") for r in routes if r.chunk is not None]
    keys += [(r.error_body, "serialization") for r in routes]
    return list(dict.fromkeys(keys))


def _content(schema: dict | None, media: str = "application/json") -> dict:
    return {media: {"schema": schema if schema is not None else {}}}


def _event(chunk_ref: dict, error_ref: dict) -> dict:
    """One server-sent event (OpenAPI 3.1 describes an event stream by its events): its data
    is a JSON chunk, an error body (an error after the status line went out), or [DONE]."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [chunk_ref, error_ref]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]},
                           "event": {"type": "string"}}}


def openapi_document(routes: list[Route], title: str, version: str) -> dict:
    refs, defs = models_json_schema(_models(routes), ref_template=_REF)
    paths: dict[str, dict] = {}
    for r in routes:
        error_ref = refs[(r.error_body, "serialization")]
        error = {"description": "", "content": _content(error_ref)}
        op: dict = {"summary": r.summary, "operationId": r.handler.__name__,
                    "tags": list(r.tags), "responses": {}}
        params = re.findall(r"{(\w+)}", r.path)
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string"}} for p in params]
        errors = r.errors
        if r.body is not None:
            op["requestBody"] = {"required": True,
                                 "content": _content(refs[(r.body, "validation")])}
            errors = tuple(sorted({*errors, 415}))  # json_body.read_json's
        if 401 in errors:  # the per-address throttle of failed keys runs before the key check
            errors = tuple(sorted({*errors, 429}))
        if isinstance(r.ok, type):
            ok = _content(refs[(r.ok, "serialization")])
        else:
            ok = _content({"type": "string"}, r.ok) if r.ok else _content(None)
        if r.chunk is not None:
            ok.update(_content(_event(refs[(r.chunk, "serialization")], error_ref),
                               "text/event-stream"))
        op["responses"][str(r.ok_status)] = {"description": _DESCRIPTIONS[r.ok_status],
                                             "content": ok}
        for status in errors:
            op["responses"][str(status)] = {**error, "description": _DESCRIPTIONS[status]}
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}

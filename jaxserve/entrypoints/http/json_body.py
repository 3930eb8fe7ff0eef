"""Reading a request's JSON body, within the app's request limits (body size, nesting, valid
Unicode: validation.load_json), for every route: a body past them is a 400, never a 500. The body
must be declared JSON (Content-Type application/json, or a +json type), else 415: a web page can
POST text/plain (or a form) to any server its visitor reaches without the browser asking first
(a CORS preflight), and such a request must change nothing (CSRF)."""

from __future__ import annotations

from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from jaxserve.config import RequestLimits
from jaxserve.errors import InvalidRequest, UnsupportedMediaType
from jaxserve.entrypoints.serving.validation import load_json, validate

LIMITS_KEY = web.AppKey("request_limits", RequestLimits)  # set by http.build_app
M = TypeVar("M", bound=BaseModel)


async def read_json(request: web.Request) -> Any:
    """The body's JSON value; UnsupportedMediaType for a body not declared JSON, InvalidRequest for
    one too large, too deep or not JSON."""
    media_type = request.content_type  # aiohttp's: lower case, without parameters
    if media_type != "application/json" and not (media_type.startswith("application/")
                                                 and media_type.endswith("+json")):
        declared = request.headers.get("Content-Type")
        raise UnsupportedMediaType(
            f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
            f"{'no Content-Type' if declared is None else repr(declared[:100])})")
    limits = request.app.get(LIMITS_KEY) or RequestLimits()
    too_large = InvalidRequest(f"the request body is larger than the server's limit of "
                               f"{limits.max_body_bytes} bytes")
    if (request.content_length or 0) > limits.max_body_bytes:
        raise too_large  # refused before reading it
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge:  # no Content-Length, or a wrong one
        raise too_large from None
    return load_json(data, limits.max_json_depth)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The body validated by `model` (InvalidRequest naming the field)."""
    return validate(model, await read_json(request))


async def read_object(request: web.Request, allowed: set[str] | None = None) -> dict:
    """The body as a dict, for routes that check their fields themselves; `allowed` None accepts
    any field."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed) if allowed is not None else []
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0])
    return body

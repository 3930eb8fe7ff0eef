"""Reading a JSON object body: malformed JSON, a non-object or an unknown field is a 400 naming
it."""

from __future__ import annotations

import json

from aiohttp import web

from jaxserve.errors import InvalidRequest


async def read_object(request: web.Request, allowed: set[str] | None = None) -> dict:
    """The body as a dict; `allowed` None accepts any field (the caller checks them)."""
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed) if allowed is not None else []
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0])
    return body

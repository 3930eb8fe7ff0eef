"""OpenAI's Batch API over HTTP: /v1/files (upload a JSONL input, list, read, download, delete)
and /v1/batches (create, list, read, cancel), in OpenAI's shapes, over the BatchService
(jaxserve/batches/service.py) the server registers with `add_batch_routes`.

Files and batches belong to the caller's tenant: another tenant's is a 404, as if it did not
exist, and a list shows only the caller's. Each call is under its tenant's limits
(`tenant_limited`) and audited as any keyed call; the lines of a batch are calls of their own,
run in the background at the lowest priority class (entrypoints/batch_lines.py)."""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from pydantic import Field

from jaxserve.batches.service import BatchService
from jaxserve.errors import InvalidRequest, UnsupportedMediaType
from jaxserve.entrypoints.http.front_door import caller, tenant_limited
from jaxserve.entrypoints.http.json_body import parse_body
from jaxserve.entrypoints.http.openapi import Route, add_routes
from jaxserve.entrypoints.serving.request_models import Body, neutral

BATCHES_KEY = web.AppKey("batches", BatchService)
_MAX_ID = 128  # ids are ~40 characters: a longer one names nothing
_MAX_FILENAME = 255
_MAX_FIELD = 64  # the `purpose` form field
Id = Annotated[str, Field(min_length=1, max_length=_MAX_ID)]


class CreateBatchRequest(Body):
    input_file_id: Id
    endpoint: Annotated[str, Field(max_length=_MAX_ID)]
    completion_window: Annotated[str, Field(max_length=16)]
    metadata: dict[str, str] | None = None
    output_expires_after: None = neutral("null: output files are kept until deleted")


def _tenant(request: web.Request) -> str:
    return caller(request).tenant.name


def _service(request: web.Request) -> BatchService:
    return request.app[BATCHES_KEY]


def _query_int(request: web.Request, name: str, default: int, top: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= top:
        raise InvalidRequest(f"'{name}' must be an integer in [1, {top}], got {text[:20]!r}",
                             name)
    return int(text)


def _query_id(request: web.Request, name: str) -> str | None:
    value = request.query.get(name)
    if value is not None and not 0 < len(value) <= _MAX_ID:
        raise InvalidRequest(f"'{name}' must name an object (an id)", name)
    return value


def _page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


async def _bounded_part(part, limit: int, param: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(65536):
        data += chunk
        if len(data) > limit:
            raise InvalidRequest(f"'{param}' is larger than the server's limit of {limit} bytes",
                                 param)
    return bytes(data)


async def _upload(request: web.Request, max_bytes: int) -> tuple[str, str, bytes]:
    """(purpose, filename, content) of a multipart/form-data upload, read within `max_bytes`."""
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType("upload a file as multipart/form-data with the fields 'file' "
                                   "and 'purpose'")
    fields: dict[str, bytes] = {}
    filename = None
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            name = part.name or ""
            if name not in ("file", "purpose"):
                raise InvalidRequest(f"Unrecognized request argument supplied: {name[:64]}",
                                     name[:64])
            if name in fields:
                raise InvalidRequest(f"'{name}' is given twice", name)
            if name == "file":
                filename = part.filename
            fields[name] = await _bounded_part(part, max_bytes if name == "file" else _MAX_FIELD,
                                               name)
    except (ValueError, AssertionError, UnicodeDecodeError) as e:  # aiohttp's for a bad body
        raise InvalidRequest(f"the body is not valid multipart/form-data: {str(e)[:200]}",
                             "file") from None
    for name in ("file", "purpose"):
        if name not in fields:
            raise InvalidRequest(f"Missing required parameter: '{name}'", name)
    try:
        purpose = fields["purpose"].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("'purpose' must be text", "purpose") from None
    name = (filename or "upload.jsonl")[:_MAX_FILENAME]
    return purpose, name, fields["file"]


# ---------------------------------------------------------------- files


@tenant_limited()
async def create_file(request: web.Request) -> web.Response:
    service = _service(request)
    purpose, filename, content = await _upload(request, service.limits.max_file_bytes)
    return web.json_response(await service.create_file(_tenant(request), purpose, filename,
                                                       content))


@tenant_limited(holds_slot=False)
async def list_files(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"'order' must be 'asc' or 'desc', got {order[:20]!r}", "order")
    purpose = request.query.get("purpose")
    data, more = await _service(request).files(
        _tenant(request), purpose[:_MAX_FIELD] if purpose is not None else None,
        _query_id(request, "after"), _query_int(request, "limit", 10_000, 10_000), order)
    return web.json_response(_page(data, more))


@tenant_limited(holds_slot=False)
async def get_file(request: web.Request) -> web.Response:
    return web.json_response(await _service(request).file(_tenant(request),
                                                          request.match_info["file_id"]))


@tenant_limited()
async def file_content(request: web.Request) -> web.Response:
    content = await _service(request).file_content(_tenant(request),
                                                   request.match_info["file_id"])
    return web.Response(body=content, content_type="application/jsonl")


@tenant_limited(holds_slot=False)
async def delete_file(request: web.Request) -> web.Response:
    return web.json_response(await _service(request).delete_file(_tenant(request),
                                                                 request.match_info["file_id"]))


# ---------------------------------------------------------------- batches


@tenant_limited(holds_slot=False)
async def create_batch(request: web.Request) -> web.Response:
    body = await parse_body(request, CreateBatchRequest)
    who = caller(request)
    return web.json_response(await _service(request).create_batch(
        who.tenant.name, who.key_id, body.input_file_id, body.endpoint, body.completion_window,
        body.metadata))


@tenant_limited(holds_slot=False)
async def list_batches(request: web.Request) -> web.Response:
    data, more = await _service(request).batches(_tenant(request), _query_id(request, "after"),
                                                 _query_int(request, "limit", 20, 100))
    return web.json_response(_page(data, more))


@tenant_limited(holds_slot=False)
async def get_batch(request: web.Request) -> web.Response:
    return web.json_response(await _service(request).batch(_tenant(request),
                                                           request.match_info["batch_id"]))


@tenant_limited(holds_slot=False)
async def cancel_batch(request: web.Request) -> web.Response:
    return web.json_response(await _service(request).cancel(_tenant(request),
                                                            request.match_info["batch_id"]))


_LIMITED = (400, 401, 429, 503)


def add_batch_routes(app: web.Application, service: BatchService) -> None:
    """Serve the Batch API from `service`; call before the server starts."""
    app[BATCHES_KEY] = service
    tags = ("batches",)
    add_routes(app, [
        Route("POST", "/v1/files", create_file, "Upload a batch input file (multipart/form-data: "
              "file, purpose=batch; OpenAI)", errors=_LIMITED + (415,), tags=tags),
        Route("GET", "/v1/files", list_files, "Your files (after, limit, order, purpose)",
              errors=_LIMITED + (404,), tags=tags),
        Route("GET", "/v1/files/{file_id}", get_file, "A file of yours",
              errors=_LIMITED + (404,), tags=tags),
        Route("GET", "/v1/files/{file_id}/content", file_content, "A file's content (JSONL)",
              ok="application/jsonl", errors=_LIMITED + (404,), tags=tags),
        Route("DELETE", "/v1/files/{file_id}", delete_file, "Delete a file of yours",
              errors=_LIMITED + (404, 409), tags=tags),
        Route("POST", "/v1/batches", create_batch, "Create a batch from an uploaded file "
              "(OpenAI)", CreateBatchRequest, errors=_LIMITED + (404, 415), tags=tags),
        Route("GET", "/v1/batches", list_batches, "Your batches, newest first (after, limit)",
              errors=_LIMITED + (404,), tags=tags),
        Route("GET", "/v1/batches/{batch_id}", get_batch, "A batch of yours",
              errors=_LIMITED + (404,), tags=tags),
        Route("POST", "/v1/batches/{batch_id}/cancel", cancel_batch, "Cancel a batch: it ends "
              "cancelled, with the output of the lines that finished",
              errors=_LIMITED + (404, 409), tags=tags),
    ])

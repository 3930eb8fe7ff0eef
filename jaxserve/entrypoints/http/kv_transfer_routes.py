"""`serve --role prefill`'s internal route, POST /internal/kv/prefill: a decode server's prompt
prefilled here (one token generated, greedy: that forward computes every prompt position's KV),
and the prompt's full pages sent back as one binary frame (jaxserve.disagg.transport).

The route has its own key, the transfer secret (a bearer token compared in constant time), not a
tenant's: the decode server admitted the request under its tenant already, and the cache salt it
sends keeps that tenant's pages apart here too. A caller that goes away (a decode server killed,
or its client gone) cancels this handler (handler_cancellation), which aborts the request:
its pages return at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from jaxserve.core.kv_transfer import export_prefix, kv_layout
from jaxserve.core.request import QoS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.disagg import transport
from jaxserve.disagg.prefill_client import PREFILL_PATH
from jaxserve.errors import EngineOverloaded, InvalidRequest, Unauthenticated
from jaxserve.entrypoints.http.json_body import read_object
from jaxserve.telemetry.metrics import KVTransferMetrics

MAX_REQUEST_ID_CHARS = 200
MAX_SALT_CHARS = 512


@dataclass(eq=False)
class _PrefillState:
    secret: str
    metrics: KVTransferMetrics
    engine: object = None  # the AsyncEngine, once warmed up


_STATE = web.AppKey("prefill_state", _PrefillState)


def add_prefill_routes(app: web.Application, secret: str, metrics: KVTransferMetrics) -> None:
    """Before the server starts; the engine comes with `set_prefill_engine` once warm."""
    app[_STATE] = _PrefillState(secret, metrics)
    app.router.add_post(PREFILL_PATH, _prefill)


def set_prefill_engine(app: web.Application, engine) -> None:
    kv_layout(engine.engine)  # ConfigError now, not per request, without the host tier
    app[_STATE].engine = engine


def _own_key(handler):
    # Not a tenant's route: the front door passes it through (as the admin API's).
    handler.admin_only = True
    return handler


@_own_key
async def _prefill(request: web.Request) -> web.Response:
    metrics, started = request.app[_STATE].metrics, time.monotonic()
    try:
        frame, num_pages = await _answer(request)
    except asyncio.CancelledError:  # the decode server (or its client) went away
        metrics.failed("cancelled")
        raise
    except Exception as e:
        metrics.failed(type(e).__name__)  # Unauthenticated, InvalidRequest, EngineOverloaded...
        raise
    metrics.sent(len(frame), num_pages, time.monotonic() - started)
    return web.Response(body=frame, content_type=transport.CONTENT_TYPE)


async def _answer(request: web.Request) -> tuple[bytes, int]:
    state = request.app[_STATE]
    given = request.headers.get("Authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {state.secret}".encode()):
        raise Unauthenticated("the KV transfer route needs 'Authorization: Bearer <secret>'")
    engine = state.engine
    if engine is None:
        raise EngineOverloaded("the prefill server is warming up")
    body = await read_object(request, {"request_id", "prompt_token_ids", "cache_salt"})
    request_id, ids, salt = (body.get("request_id"), body.get("prompt_token_ids"),
                             body.get("cache_salt"))
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} "
                             f"characters", "request_id")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise InvalidRequest("prompt_token_ids must be a list of token ids", "prompt_token_ids")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS):
        raise InvalidRequest(f"cache_salt must be null or a string of at most {MAX_SALT_CHARS} "
                             f"characters", "cache_salt")
    # prepare checks the ids against the vocabulary, the context and the pool.
    prepared = engine.prepare(f"prefill-{uuid.uuid4().hex}", {"prompt_token_ids": ids},
                              SamplingParams(max_tokens=1, temperature=0.0),
                              qos=QoS(cache_salt=salt))
    async with contextlib.aclosing(engine.generate(prepared=prepared)) as stream:
        async for _ in stream:
            pass
    pages = await engine.call(lambda e: export_prefix(e, ids, salt))
    # Off the event loop, as the decode side checks it: hundreds of MB for a long prompt.
    frame = await asyncio.to_thread(transport.encode, request_id, kv_layout(engine.engine), pages)
    return frame, pages.shape[1]

"""The generation routes: POST /v1/chat/completions and /v1/completions (the Responses API's
routes are responses_routes.py, which share `keyed`). Each reads its body, hands it with its call to
OpenAIServing (which parses and admits it, or ends the call refused) and answers the Generation
whole or streamed, inside its `running()` (which ends the call); an Idempotency-Key's repeat
replays the stored answer instead, and ends the call as a replay. A deterministic request on a
server with a response cache may be answered from it (serving/response_caching.py): every answer
then says which in its `x-jaxserve-cache` header.

A client that goes away (mid-stream or while waiting for a non-streaming answer) cancels its
handler (the server runs with handler cancellation on), and `running()` aborts its engine
requests, so their KV pages return at once."""

from __future__ import annotations

import functools
from typing import Awaitable, Callable

from aiohttp import web

from jaxserve.gateway import idempotency, response_cache
from jaxserve.entrypoints.serving import degradation, protocol
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.front_door import call_context, call_of
from jaxserve.entrypoints.serving.generation import Generation
from jaxserve.entrypoints.http.json_body import read_json
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.outcome import Outcome
from jaxserve.entrypoints.serving.response_caching import CacheUse, cache_control
from jaxserve.entrypoints.http.sse import SSE_HEADERS, Keep, plain_error_event, stream_response

_CACHE_USE = web.RequestKey("cache_use", CacheUse)  # a cacheable route's use of the cache


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state: AppState = request.app[STATE_KEY]
    ctx = call_context(request)
    serving = state.require_serving()
    body = await read_json(request)
    model = body.get("model") if isinstance(body, dict) else None  # not an object: _run's 400
    return await keyed(request, ctx, kind, model,
                        lambda keep: _run(request, serving, kind, body, ctx, keep))


async def keyed(request: web.Request, ctx: CallContext, kind: str, model,
                 answer: Callable[[Keep | None], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    """`answer(keep)`, or with an Idempotency-Key the stored answer of its earlier run: `keep`
    stores what this run answers in full, for a retry to replay."""
    state: AppState = request.app[STATE_KEY]
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    if key is None:
        return await answer(None)
    tenant = ctx.principal.tenant.name
    fingerprint = idempotency.fingerprint(request.path.encode() + b"\n" + await request.read())
    stored = state.idempotency.begin(tenant, key, fingerprint)
    if stored is not None:  # the model does not run again
        call_of(request).end(Outcome(protocol.new_id("replay"), ctx, kind=kind, model=model,
                                     version=stored.version, idempotent_replay=True))
        return await _replay(request, stored, {"Idempotent-Replayed": "true"})
    try:
        return await answer(functools.partial(state.idempotency.complete, tenant, key,
                                              fingerprint))
    finally:
        state.idempotency.abandon(tenant, key)  # unless completed: a retry then runs again


async def _run(request: web.Request, serving: OpenAIServing, kind: str, body,
               ctx: CallContext, keep: Keep | None) -> web.StreamResponse:
    state: AppState = request.app[STATE_KEY]
    use = None
    if state.response_cache is not None:
        read, write = cache_control(request.headers.get("Cache-Control"))
        use = request[_CACHE_USE] = CacheUse(state.response_cache, read, write)
    gen = await serving.prepare_async(kind, body, ctx, call_of(request), cache=use)
    if isinstance(gen, response_cache.CachedAnswer):  # a hit: its call has ended
        stored = idempotency.StoredResponse(
            200, (("Content-Type", "application/json" if gen.body is not None
                   else "text/event-stream"), *degradation.headers(gen.degraded).items()),
            body=gen.body, events=gen.events, version=gen.version)
        if keep is not None:
            keep(stored)
        return await _replay(request, stored, {})
    keep = _both(keep, use.keeper(gen) if use is not None else None)
    return await respond(gen, gen.response, lambda: stream_response(
        request, gen, gen.chunks(state.config.keepalive_seconds), plain_error_event, keep=keep),
        keep)


def _both(a: Keep | None, b: Keep | None) -> Keep | None:
    if a is None or b is None:
        return a or b
    return lambda stored: (a(stored), b(stored))


async def cache_header(request: web.Request, response: web.StreamResponse) -> None:
    """x-jaxserve-cache on a cacheable route's answer: hit, miss or bypass (not errors)."""
    use = request.get(_CACHE_USE)
    if use is not None and response.status < 300:
        response.headers[response_cache.HEADER] = use.status


async def respond(gen: Generation, whole, stream, keep: Keep | None = None
                   ) -> web.StreamResponse:
    """Answer an admitted generation, `whole()` (a JSON body) or `stream()` (the streamed
    response), inside `gen.running()` (its call ended, its engine requests freed however it
    ends). `keep` (for an Idempotency-Key) receives what a replay sends once the request is
    answered in full: the body, or the SSE events (kept before the stream's end goes out: a
    client that closes right after [DONE] cancels this handler)."""
    async with gen.running():
        if gen.parsed.stream:
            return await stream()
        degraded = degradation.headers(gen.degraded)
        resp = web.json_response(await whole(), headers=degraded)
        if keep is not None:  # a replay says what the original was, degraded or not
            keep(idempotency.StoredResponse(200, (("Content-Type", resp.content_type),
                                                  *degraded.items()),
                                            body=resp.body, version=gen.version.name))
        return resp


async def _replay(request: web.Request, stored: idempotency.StoredResponse,
                  headers: dict[str, str]) -> web.StreamResponse:
    headers = {**dict(stored.headers), **headers}
    if stored.body is not None:
        return web.Response(status=stored.status, body=stored.body, headers=headers)
    resp = web.StreamResponse(status=stored.status, headers={**SSE_HEADERS, **headers})
    await resp.prepare(request)
    for event in stored.events:
        await resp.write(event)
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")

"""Server-sent events: the framing, and the streamed response of a generation, whose status
line waits for the engine's first output (so a request refused while queued is a plain error
reply), with an error after it as one error event."""

from __future__ import annotations

import json
from typing import Callable

from aiohttp import web

from jaxserve.gateway import idempotency
from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.entrypoints.http.front_door import logged_error_reply
from jaxserve.entrypoints.serving import degradation
from jaxserve.entrypoints.serving.generation import Generation
from jaxserve.entrypoints.serving.streams import StreamStalled, write_within

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
# Receives what an Idempotency-Key's replay sends, once the request is answered in full.
Keep = Callable[[idempotency.StoredResponse], None]


def sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {data}\n\n").encode()


def plain_error_event(exc: Exception) -> bytes:
    # As vLLM does: one error event (OpenAI clients raise it), then the usual end.
    return sse(logged_error_reply(exc)[1])


async def stream_response(request: web.Request, gen: Generation, events, error_event,
                          done: bool = True, keep: Keep | None = None) -> web.StreamResponse:
    """The SSE response of `events` (JSON payloads, None for a keep-alive); an error reported in
    it is left in `gen.error`. A payload with a "type" is a named event (the Responses API's);
    `done`: end with `data: [DONE]` (chat and completions).

    The status line waits for the engine's first output (or the first keep-alive): a request
    refused while queued (deadline 504, shed 503, queue time 429) is then still a plain error
    reply. After it, an error is one error event. A request its route degraded says why in
    x-jaxserve-degraded, as a whole answer does.

    A client that stops reading is dropped once one write has waited the server's
    stream_write_timeout_s (StreamStalled, left in `gen.error`: the request is aborted, its
    pages freed); the engine keeps only its latest output meanwhile."""
    resp = web.StreamResponse(headers={**SSE_HEADERS, **degradation.headers(gen.degraded)})
    try:
        await _write_events(request, resp, gen, events, error_event, done, keep)
    except StreamStalled as exc:
        gen.error = exc
        if request.transport is not None:
            request.transport.abort()  # what it holds unsent is dropped with it
    return resp


async def _write_events(request: web.Request, resp: web.StreamResponse, gen: Generation, events,
                        error_event, done: bool, keep: Keep | None) -> None:
    held: list[bytes] = []  # events before the engine answered (chat's role, echo, created)
    sent: list[bytes] = []  # what a replay sends (keep-alives left out)
    timeout_s = request.app[STATE_KEY].config.stream_write_timeout_s

    async def write(data: bytes) -> None:
        # Drains the transport: each token leaves as it is produced, or the writer waits.
        await write_within(resp.write(data), timeout_s)

    async def send(data: bytes) -> None:
        sent.append(data)
        await write(data)

    try:
        async for payload in events:
            data = None if payload is None else sse(payload, payload.get("type"))
            if not resp.prepared:
                if data is not None and not gen.engine_answered:
                    held.append(data)
                    continue
                await resp.prepare(request)
                gen.stream_started()
                for h in held:
                    await send(h)
            if data is None:
                await write(b": keep-alive\n\n")
            else:
                await send(data)
    except ConnectionResetError:  # the client is gone: nobody to report to
        raise
    except Exception as exc:  # noqa: BLE001 - reported below
        if not resp.prepared:
            raise  # nothing sent yet: a plain error reply
        await write(error_event(exc))
        gen.error = exc
    if not resp.prepared:
        await resp.prepare(request)
        gen.stream_started()
        for h in held:
            await send(h)
    end = [sse("[DONE]")] if done else []
    # Kept before the end leaves (see openai_routes.respond).
    if gen.error is None and keep is not None:
        keep(idempotency.StoredResponse(
            200, (("Content-Type", "text/event-stream"),
                  *degradation.headers(gen.degraded).items()),
            events=(*sent, *end), version=gen.version.name))
    for data in end:
        await write(data)
    await resp.write_eof()

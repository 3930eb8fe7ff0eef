"""Anthropic's Messages API: POST /v1/messages (answered whole or streamed with Anthropic's
events) and POST /v1/messages/count_tokens, over the chat path (entrypoints/serving/anthropic.py)
and the same front door as every route: the key (Anthropic's clients send it as `x-api-key`),
the tenant's limits, policy, audit and idempotency. Errors on these routes are Anthropic's error
bodies (front_door.py)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import InvalidRequest, anthropic_error_body
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.front_door import (ANTHROPIC_PREFIX, call_context, call_of,
                                                  logged_error_reply, tenant_limited)
from jaxserve.entrypoints.http.json_body import read_json
from jaxserve.entrypoints.http.openai_routes import keyed, respond
from jaxserve.entrypoints.http.openapi import Route
from jaxserve.entrypoints.http.sse import Keep, sse, stream_response
from jaxserve.entrypoints.serving.admission import CallContext
from jaxserve.entrypoints.serving.anthropic import (MessageEvents, MessageObject,
                                                    cache_breakpoints, chat_body, rename_param)
from jaxserve.entrypoints.serving.anthropic_models import (AnthropicError, MessageEvent,
                                                           MessageOut, TokenCount,
                                                           messages_models)
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.validation import validate


async def messages(request: web.Request) -> web.StreamResponse:
    state: AppState = request.app[STATE_KEY]
    serving = state.require_serving()
    req = validate(messages_models(state.config.limits).messages, await read_json(request))
    ctx = call_context(request)
    return await keyed(request, ctx, "chat", req.model,
                       lambda keep: _answer(request, serving, req, ctx, keep))


async def _answer(request: web.Request, serving: OpenAIServing, req, ctx: CallContext,
                  keep: Keep | None) -> web.StreamResponse:
    state: AppState = request.app[STATE_KEY]
    try:
        gen = await serving.prepare_async("chat", chat_body(req), ctx, call_of(request),
                                          pins=cache_breakpoints(req))
    except InvalidRequest as exc:
        raise rename_param(exc) from None
    message = MessageObject(req, gen.version.name)

    def finish_info():
        return (gen.stop_reasons.get(0), gen.cached_tokens.get(0, 0),
                gen.cache_creation_tokens.get(0, 0))

    async def whole():
        completion = await gen.response()
        return message.from_chat(completion, *finish_info())

    events = MessageEvents(message, gen.prompt_tokens)

    def error_event(exc: Exception) -> bytes:
        status, body = logged_error_reply(exc)
        return sse(anthropic_error_body(status, body), "error")

    return await respond(gen, whole, lambda: stream_response(
        request, gen, events.events(gen.chunks(state.config.keepalive_seconds), finish_info),
        error_event, done=False, keep=keep), keep)


@tenant_limited()  # the template renders in an executor, holding a slot
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would send them to the model (template, tools)."""
    state: AppState = request.app[STATE_KEY]
    serving = state.require_serving()
    req = validate(messages_models(state.config.limits).count_tokens, await read_json(request))
    ctx = call_context(request)
    try:
        count = await asyncio.get_running_loop().run_in_executor(
            None, serving.count_prompt_tokens, chat_body(req), ctx)
    except InvalidRequest as exc:
        raise rename_param(exc) from None
    return web.json_response({"input_tokens": count})


def routes(config: ServerConfig) -> list[Route]:
    gen = (400, 401, 404, 409, 422, 429, 500, 503, 504)
    models = messages_models(config.limits)
    return [
        Route("POST", ANTHROPIC_PREFIX, messages, "Message (Anthropic Messages API)",
              models.messages, MessageOut, chunk=MessageEvent, errors=gen,
              tags=("anthropic",), error_body=AnthropicError),
        Route("POST", ANTHROPIC_PREFIX + "/count_tokens", count_tokens,
              "The input tokens a message request would use (Anthropic Messages API)",
              models.count_tokens, TokenCount, errors=(400, 401, 404, 429, 503),
              tags=("anthropic",), error_body=AnthropicError),
    ]

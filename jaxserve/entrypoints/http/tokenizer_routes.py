"""The tokenizer routes, in vLLM's shapes: POST /tokenize (a prompt or chat messages -> token ids),
POST /detokenize (token ids -> text) and GET /tokenizer_info (the tokenizer's configuration, what
clients that tokenize with the server's tokenizer read first: lm-evaluation-harness's "remote"
backend). Each is keyed and tenant-scoped like generation (a model the tenant may not use does not
exist for it) and answered on the event loop at once, so each input is bounded: a prompt of at most
MAX_TOKENIZE_CHARS characters, at most MAX_DETOKENIZE_TOKENS ids (request_models.py).
"""

from __future__ import annotations

from aiohttp import web

from jaxserve.config import ServerConfig
from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.http.app_state import STATE_KEY, AppState
from jaxserve.entrypoints.http.front_door import caller, tenant_limited
from jaxserve.entrypoints.http.json_body import parse_body
from jaxserve.entrypoints.http.openapi import Route
from jaxserve.entrypoints.serving import protocol
from jaxserve.entrypoints.serving import response_models as out
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.request_models import DetokenizeRequest, request_models

# What HF's tokenizer_config.json says of the class; lm-eval reads only the special tokens.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
MAX_MODEL_NAME = 256  # characters of /tokenizer_info's `?model=`


def _engine_for(request: web.Request, serving: OpenAIServing, model: str | None):
    """The engine whose tokenizer a tokenizer request means (one the tenant may use: without
    `model`, the served model)."""
    if model is None:
        if serving.engine is None:
            raise InvalidRequest("'model' is required: this server serves several models",
                                 param="model")
        caller(request).tenant.check_model(request.app[STATE_KEY].model_name)
        return serving.engine
    caller(request).tenant.check_model(model)
    return serving.engine_for(model)


@tenant_limited(holds_slot=False)  # answered on the event loop at once: no slot, no tokens
async def tokenize(request: web.Request) -> web.Response:
    state: AppState = request.app[STATE_KEY]
    serving = state.require_serving()
    body = await parse_body(request, request_models(state.config.limits).tokenize)
    engine = _engine_for(request, serving, body.model)
    tok = engine.tokenizer
    if body.prompt is not None:
        add_special = body.add_special_tokens is not False
        ids = tok.encode(body.prompt, add_special_tokens=add_special)
    elif body.messages is not None:
        ids = tok.apply_chat_template(protocol.flatten_messages(body.messages),
                                      add_generation_prompt=body.add_generation_prompt
                                      is not False)
    else:
        raise InvalidRequest("give 'prompt' (a string) or 'messages' (a list)", param="prompt")
    reply = {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}
    if body.return_token_strs:
        reply["token_strs"] = [tok.decode([i], skip_special_tokens=False) for i in ids]
    return web.json_response(reply)


@tenant_limited(holds_slot=False)
async def detokenize(request: web.Request) -> web.Response:
    serving = request.app[STATE_KEY].require_serving()
    body = await parse_body(request, DetokenizeRequest)
    tok = _engine_for(request, serving, body.model).tokenizer
    serving.check_token_ids(tok, body.tokens, "tokens")
    return web.json_response({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})


@tenant_limited(holds_slot=False)
async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's: the tokenizer's configuration as tokenizer_config.json holds it (`?model=` picks a
    version when the server serves several)."""
    serving = request.app[STATE_KEY].require_serving()
    model = request.query.get("model")
    if model is not None and not 0 < len(model) <= MAX_MODEL_NAME:
        raise InvalidRequest(f"'model' must be 1 to {MAX_MODEL_NAME} characters", param="model")
    engine = _engine_for(request, serving, model)
    tok = engine.tokenizer
    return web.json_response({
        "tokenizer_class": TOKENIZER_CLASS, "bos_token": tok.bos_token,
        "eos_token": tok.eos_token, "pad_token": None, "chat_template": tok.chat_template,
        "model_max_length": engine.max_model_len, "vocab_size": tok.vocab_size})


def routes(config: ServerConfig) -> list[Route]:
    models = request_models(config.limits)
    errors = (400, 401, 404, 429, 503)
    return [
        Route("POST", "/tokenize", tokenize, "Prompt or chat messages -> token ids (vLLM)",
              models.tokenize, out.Tokens, errors=errors, tags=("tokens",)),
        Route("POST", "/detokenize", detokenize, "Token ids -> text (vLLM)", DetokenizeRequest,
              out.Detokenized, errors=errors, tags=("tokens",)),
        Route("GET", "/tokenizer_info", tokenizer_info,
              "The tokenizer's configuration, as tokenizer_config.json (vLLM)",
              ok=out.TokenizerInfo, errors=errors, tags=("tokens",)),
    ]

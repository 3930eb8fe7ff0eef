"""OpenAI request parsing and response shapes, with no I/O: the HTTP layer stays thin.

Every field of a request is either used or rejected. Known OpenAI fields we do not implement are
accepted only at their neutral value (e.g. `logit_bias: {}`); anything else is an InvalidRequest
(400), as is a field nobody has heard of — OpenAI itself answers "Unrecognized request argument".
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxserve.errors import InvalidRequest
from jaxserve.sampling import SamplingParams

# Fields whose value passes straight into SamplingParams (OpenAI name -> SamplingParams name).
_SAMPLING_FIELDS = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    # vLLM-style extras
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "min_tokens": "min_tokens", "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# Known OpenAI fields we accept only at their neutral value.
_NEUTRAL = {
    "logit_bias": (None, {}), "user": None, "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": None,
    "response_format": None, "service_tier": None, "store": (None, False), "metadata": None,
    "suffix": (None, ""), "best_of": None, "modalities": None, "audio": None, "prediction": None,
    "reasoning_effort": None, "web_search_options": None,
}
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", "logprobs"} | set(
    _SAMPLING_FIELDS)
# "rag" (retrieval-augmented chat) is ours; OpenAIServing checks it against the RAG service.
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "rag"} | set(
    _NEUTRAL)
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"} | set(_NEUTRAL)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompts: list  # chat: [messages]; completion: list of str or list[int]
    sampling_params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top-n requested, None when off
    max_tokens_given: bool  # False: the server fills max_tokens from the remaining context
    rag: Any = None  # chat only: the raw "rag" option, None when absent


def _type_error(name: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}",
                          param=name)


def _check_neutral(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        if name not in body:
            continue
        value = body[name]
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if name == "user" and (value is None or isinstance(value, str)):
            continue  # an opaque end-user id, meaningful to OpenAI's abuse tracking only
        if name == "response_format" and value in (None, {"type": "text"}):
            continue
        if name == "best_of" and value in (None, 1, body.get("n", 1)):
            continue
        if name in ("parallel_tool_calls", "metadata", "service_tier", "modalities", "audio",
                    "prediction", "reasoning_effort", "web_search_options") and value is None:
            continue
        if value not in allowed:
            raise InvalidRequest(f"'{name}' is not supported by this server", param=name)


def _check_unknown(body: dict, allowed: set) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0])


def _opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stop) > 16:
        raise InvalidRequest("'stop' takes at most 16 strings", param="stop")
    if any(s == "" for s in stop):
        raise InvalidRequest("'stop' strings must not be empty", param="stop")
    return tuple(stop)


def _common(body: dict, kind: str, allowed: set) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_unknown(body, allowed)
    _check_neutral(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _type_error("stream", "a boolean", stream)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise InvalidRequest("'stream_options' supports only include_usage",
                                 param="stream_options")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                                 param="stream_options")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _type_error("stream_options.include_usage", "a boolean", include_usage)
    kwargs = {dst: body[src] for src, dst in _SAMPLING_FIELDS.items()
              if src in body and body[src] is not None}
    if "stop_token_ids" in kwargs and isinstance(kwargs["stop_token_ids"], list):
        kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
    kwargs["stop"] = _stop(body)
    return dict(model=model, stream=bool(stream), include_usage=include_usage, kwargs=kwargs)


def _sampling_params(kwargs: dict) -> SamplingParams:
    # SamplingParams validates every field and names it in its InvalidRequest.
    return SamplingParams(**kwargs)


def parse_chat_request(body: Any) -> ParsedRequest:
    c = _common(body, "chat", _CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'",
                                 param="messages")
        if m["role"] not in ("system", "user", "assistant", "developer"):
            raise InvalidRequest(f"messages[{i}].role {m['role']!r} is not supported",
                                 param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                     param="messages")
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string", param="messages")
    kwargs = c["kwargs"]
    max_tokens = _opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    kwargs["max_tokens"] = max_tokens  # None: as many as fit (the engine decides)
    want_logprobs = body.get("logprobs", False)
    if want_logprobs is not None and not isinstance(want_logprobs, bool):
        raise _type_error("logprobs", "a boolean", want_logprobs)
    top = _opt_int(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequest(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}",
                             param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    messages = [_flatten_content(m) for m in messages]
    return ParsedRequest("chat", c["model"], [messages], _sampling_params(kwargs), c["stream"],
                         c["include_usage"], False, logprobs, max_tokens is not None,
                         body.get("rag"))


def _flatten_content(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    return {"role": message["role"], "content": content}


def parse_completion_request(body: Any) -> ParsedRequest:
    c = _common(body, "completion", _COMPLETION_FIELDS)
    prompt = body.get("prompt")
    prompts: list
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(is_token_list(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    elif is_token_list(prompt) and prompt:
        prompts = [list(prompt)]
    else:
        raise InvalidRequest("'prompt' must be a string, a list of strings, a list of token ids or "
                             "a list of such lists", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise InvalidRequest("'prompt' must not be empty", param="prompt")
    kwargs = c["kwargs"]
    max_tokens = _opt_int(body, "max_tokens")
    kwargs["max_tokens"] = 16 if max_tokens is None else max_tokens  # OpenAI's default
    logprobs = _opt_int(body, "logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}",
                                 param="logprobs")
        kwargs["logprobs"] = logprobs
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise _type_error("echo", "a boolean", echo)
    if echo and logprobs is not None:
        raise InvalidRequest("'echo' with 'logprobs' (prompt logprobs) is not supported",
                             param="echo")
    return ParsedRequest("completion", c["model"], prompts, _sampling_params(kwargs), c["stream"],
                         c["include_usage"], echo, logprobs, True)


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

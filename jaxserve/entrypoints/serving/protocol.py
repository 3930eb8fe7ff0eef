"""OpenAI requests -> ParsedRequest, and response shapes, with no I/O: the HTTP layer stays thin.

The body is checked against the pydantic models of request_models.py (strict types, unknown fields
refused, known OpenAI fields we do not implement accepted only at their neutral value, the request
limits) by validation.py, which names the field in every InvalidRequest (400). What remains here
is turning a valid body into what the engine takes: SamplingParams (which checks the sampling
ranges) and the prompts.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxserve.config import RequestLimits
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.serving.cache_pins import Breakpoint, chat_breakpoints
from jaxserve.entrypoints.serving.request_models import request_models
from jaxserve.entrypoints.serving.structured_fields import structured_constraint, tool_fields
from jaxserve.entrypoints.serving.validation import validate
from jaxserve.tool_calling.functions import FunctionTool, ToolChoice

# Fields whose value passes straight into SamplingParams (the names are the same).
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
    # vLLM-style extras
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "num_speculative_tokens",
    "prompt_logprobs")
_DEFAULT_LIMITS = RequestLimits()


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
    rag: dict | None = None  # chat only: the "rag" option, None when absent
    tools: tuple[FunctionTool, ...] = ()  # chat only
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    continuous_usage: bool = False  # usage on every streamed chunk (vLLM's extension)
    user: str | None = None  # OpenAI's end-user id: the key of a route with sticky = "user"
    chat_template_kwargs: dict | None = None  # chat only: more chat-template variables
    # completions' echo with max_tokens 0: the prompt is scored, the one token the engine draws
    # is dropped from the answer
    score_only: bool = False
    prompt_logprobs: int | None = None  # vLLM's field: top-n of the response's prompt_logprobs
    cache_breakpoints: tuple[Breakpoint, ...] = ()  # chat only: prompt_cache_breakpoint pins


def _sampling_params(body, **fields) -> SamplingParams:
    """SamplingParams from the body's sampling fields and its structured-output constraint; it
    checks every range and names the field in its InvalidRequest."""
    kwargs = {name: getattr(body, name) for name in _SAMPLING_FIELDS
              if getattr(body, name) is not None}
    kwargs["structured_outputs"] = structured_constraint(body)
    if body.stop_token_ids is not None:
        kwargs["stop_token_ids"] = tuple(body.stop_token_ids)
    stop = body.stop
    kwargs["stop"] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    return SamplingParams(**{**kwargs, **fields})


def _include_usage(body) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


def _continuous_usage(body) -> bool:
    # As in vLLM: only together with include_usage.
    return _include_usage(body) and bool(body.stream_options.continuous_usage_stats)


def parse_chat_request(body: Any, limits: RequestLimits = _DEFAULT_LIMITS) -> ParsedRequest:
    req = validate(request_models(limits).chat, body)
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # max_tokens None: as many as fit (the serving layer and the engine decide)
    params = _sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    rag = req.rag.model_dump(exclude_none=True) if req.rag is not None else None
    tools, tool_choice, parallel = tool_fields(req, params.structured_outputs)
    messages = flatten_messages(req.messages)
    options = req.prompt_cache_options
    pins = chat_breakpoints(req.messages, messages, options.ttl if options is not None else None)
    # OpenAI's prompt_cache_key is its cache-locality key, "replacing user" for it: here the key
    # of a sticky route, so requests sharing a prefix land on the version that cached it.
    sticky = req.prompt_cache_key if req.prompt_cache_key is not None else req.user
    return ParsedRequest("chat", req.model, [messages], params,
                         bool(req.stream), _include_usage(req), False, logprobs,
                         max_tokens is not None, rag, tools, tool_choice, parallel,
                         _continuous_usage(req), sticky, req.chat_template_kwargs,
                         prompt_logprobs=req.prompt_logprobs, cache_breakpoints=tuple(pins))


def flatten_messages(messages) -> list[dict]:
    """Validated ChatMessages as the chat template takes them: text parts joined, an assistant's
    tool_calls and reasoning_content and a tool message's tool_call_id kept
    (jaxserve.tool_calling.prompt renders them)."""
    out = []
    for m in messages:
        content = m.content
        if content is None:
            content = ""
        elif not isinstance(content, str):
            content = "".join(p.text for p in content)
        message = {"role": m.role, "content": content}
        if m.tool_calls is not None:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def parse_completion_request(body: Any, limits: RequestLimits = _DEFAULT_LIMITS
                             ) -> ParsedRequest:
    req = validate(request_models(limits).completion, body)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
    else:
        prompts = [prompt]  # one prompt of token ids
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
    score_only = max_tokens == 0  # with echo (checked by the model)
    fields = dict(max_tokens=max(max_tokens, 1), logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:
        # The echoed prompt's tokens carry logprobs too: the engine scores the prompt.
        fields["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    params = _sampling_params(req, **fields)
    return ParsedRequest("completion", req.model, prompts, params, bool(req.stream),
                         _include_usage(req), bool(req.echo), req.logprobs, True,
                         continuous_usage=_continuous_usage(req), user=req.user,
                         score_only=score_only, prompt_logprobs=req.prompt_logprobs)


def prompt_ids(tokenizer, parsed: ParsedRequest, prompt) -> list[int]:
    """One prompt of `parsed` as token ids, tokenized once by the tokenizer of the version that
    runs it (a shadow copy's by its own); the engine's `prepare` checks the ids (empty,
    vocabulary, context)."""
    if parsed.kind == "chat":
        return list(tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tools=parsed.tools,
            template_kwargs=parsed.chat_template_kwargs))
    return list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: the prompt tokens read from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}

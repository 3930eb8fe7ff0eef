"""POST /v1/messages: Anthropic's Messages API, served by the chat path (as responses.py serves
OpenAI's Responses API).

A validated MessagesRequest becomes a chat completion body (`chat_body`): `system` a system
message first; a user message's `tool_result` blocks `tool` messages (in order, before its text),
its text blocks one user message; an assistant message's text its content, its `thinking` its
`reasoning_content`, its `tool_use` blocks its `tool_calls`; `tools` function tools with their
`input_schema`; `tool_choice` auto / any / tool / none the chat's "auto" / "required" / named /
"none" (`disable_parallel_tool_use`: `parallel_tool_calls` false); `thinking` the template's
`enable_thinking` (on for enabled and adaptive); `output_config.format` a strict json_schema
response format; `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens` and
`metadata.user_id` their chat equivalents; `cache_control` breakpoints (`cache_breakpoints`) pin
their prompt prefix in the prefix cache for their TTL (cache_pins.py). The chat path does everything else (template, tools,
reasoning parser, constraints, limits), and its answer, whole or streamed, becomes a `message`
or Anthropic's event stream (`MessageEvents`). An error the chat path raises names the Messages
field (`rename_param`).

No I/O and no JAX: entrypoints/http/anthropic_routes.py owns the routes.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.serving.cache_pins import DEFAULT_TTL, MAX_BREAKPOINTS, TTL_SECONDS
from jaxserve.entrypoints.serving.anthropic_models import (
    AssistantMessage, TextBlock, ThinkingBlock, ThinkingDisabled, ToolChoiceAny, ToolChoiceNone,
    ToolChoiceTool, ToolResultBlock, ToolUseBlock)

# Chat field -> the Messages field it came from, for error messages.
_PARAMS = {"max_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata.user_id",
           "chat_template_kwargs": "thinking", "response_format": "output_config.format"}
# The chat path's finish_reason -> Anthropic's stop_reason ("stop" is end_turn, or
# stop_sequence when one of the request's stop sequences ended it).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "content_filter": "refusal"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def rename_param(exc: InvalidRequest) -> InvalidRequest:
    """The chat path's error about a field, naming the Messages field instead."""
    param = exc.param or ""
    head = param.split(".")[0].split("[")[0]
    if head not in _PARAMS or _PARAMS[head] == head:
        return exc
    new = _PARAMS[head] + param[len(head):]
    return type(exc)(str(exc).replace(f"'{param}", f"'{new}"), param=new)


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _tool_result(block: ToolResultBlock) -> dict:
    text = _text(block.content)
    if block.is_error:  # the model sees the failure only through the text
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _assistant(message: AssistantMessage) -> dict:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    out: dict[str, Any] = {"role": "assistant", "content": "".join(
        b.text for b in message.content if isinstance(b, TextBlock)) or None}
    thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlock))
    if thinking:
        out["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    elif out["content"] is None:
        out["content"] = ""
    return out


def _system(req: Any, upto: int | None = None) -> list[dict]:
    if req.system is None:
        return []
    blocks = req.system if isinstance(req.system, str) or upto is None else req.system[:upto + 1]
    return [{"role": "system", "content": _text(blocks)}]


def _chat_of(message: Any, upto: int | None = None) -> list[dict]:
    """The chat messages of one Messages message; `upto`: only its blocks through that index
    (a breakpoint's prefix; an assistant message stays whole)."""
    if message.role == "assistant":
        return [_assistant(message)]
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    blocks = message.content if upto is None else message.content[:upto + 1]
    out = [_tool_result(b) for b in blocks if isinstance(b, ToolResultBlock)]
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_messages(req: Any) -> list[dict]:
    """The chat messages of a validated MessagesRequest (or CountTokensRequest)."""
    messages = _system(req)
    for message in req.messages:
        messages.extend(_chat_of(message))
    return messages


def _ttl_s(control: Any) -> float:
    return TTL_SECONDS[control.ttl or DEFAULT_TTL]


def cache_breakpoints(req: Any) -> list[tuple[list[dict], float]]:
    """Each `cache_control` as (the chat messages through the block that carries it, TTL s),
    in prompt order (cache_pins.py finds its token position). A tool's breakpoint ends at the
    system message (the templates render tools there, or before it); the top-level one at the
    last message."""
    out = []
    system = _system(req)
    if any(t.cache_control is not None for t in req.tools or ()):
        out.append((system, min(_ttl_s(t.cache_control) for t in req.tools
                                if t.cache_control is not None)))
    if not isinstance(req.system, (str, type(None))):
        out.extend((_system(req, i), _ttl_s(b.cache_control))
                   for i, b in enumerate(req.system) if b.cache_control is not None)
    messages = list(system)
    for message in req.messages:
        if not isinstance(message.content, str):
            out.extend((messages + _chat_of(message, i), _ttl_s(b.cache_control))
                       for i, b in enumerate(message.content)
                       if getattr(b, "cache_control", None) is not None)
        messages.extend(_chat_of(message))
    if req.cache_control is not None:
        out.append((messages, _ttl_s(req.cache_control)))
    if len(out) > MAX_BREAKPOINTS:  # each one renders the prompt again
        raise InvalidRequest(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                             f"provided, got {len(out)}", param="cache_control")
    return out


def _tools(req: Any, body: dict) -> None:
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, ToolChoiceNone):
        body["tool_choice"] = "none"
        return
    if isinstance(choice, ToolChoiceTool):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else "auto"
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False


def chat_body(req: Any) -> dict:
    """The chat completion body equivalent to a validated MessagesRequest (or, without the
    sampling fields, a CountTokensRequest)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    _tools(req, body)
    if req.thinking is not None:
        body["chat_template_kwargs"] = {
            "enable_thinking": not isinstance(req.thinking, ThinkingDisabled)}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_, "strict": True}}
    if not hasattr(req, "max_tokens"):  # count_tokens: the prompt only
        return body
    body["max_tokens"] = req.max_tokens
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("top_k", req.top_k)):
        if value is not None:
            body[name] = value
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # message_delta carries usage
    return body


def stop_reason(finish: str | None, matched: int | str | None,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finish_reason and what ended it (a stop string, a
    stop token id, or None)."""
    if finish == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish, finish), None


def usage(input_tokens: int, output_tokens: int, cached_tokens: int,
          created_tokens: int = 0) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens neither read from the cache nor
    written under a new pin (`created_tokens`: cache_creation_input_tokens)."""
    return {"input_tokens": input_tokens - cached_tokens - created_tokens,
            "output_tokens": output_tokens, "cache_creation_input_tokens": created_tokens,
            "cache_read_input_tokens": cached_tokens}


class MessageObject:
    """The `message` object of one request."""

    def __init__(self, req: Any, model: str):
        self.req = req
        self.model = model
        self.id = new_id("msg")

    def build(self, content: list[dict], reason: tuple[str | None, str | None],
              usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
                "usage": usage_}

    def from_chat(self, completion: dict, matched: int | str | None, cached_tokens: int,
                  created_tokens: int = 0) -> dict:
        """The whole message, from the chat completion body of the same request."""
        choice = completion["choices"][0]
        message = choice["message"]
        content: list[dict] = []
        if message.get("reasoning_content") is not None:
            content.append({"type": "thinking", "thinking": message["reasoning_content"],
                            "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append(_tool_use(call["id"], call["function"]["name"],
                                     _arguments(call["function"]["arguments"])))
        u = completion["usage"]
        return self.build(content, stop_reason(choice["finish_reason"], matched,
                                               self.req.stop_sequences),
                          usage(u["prompt_tokens"], u["completion_tokens"], cached_tokens,
                                created_tokens))


def _tool_use(call_id: str, name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def _arguments(text: str) -> dict:
    # The tool-call parser hands back JSON objects only; a cut call (max_tokens) may not be one.
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageEvents:
    """The chat path's streamed chunks -> Anthropic's event stream: message_start; per content
    block content_block_start, its deltas (thinking_delta, text_delta or input_json_delta) and
    content_block_stop; message_delta (stop_reason and usage) and message_stop. Keep-alives stay
    None (an SSE comment, which Anthropic's clients skip as they skip its `ping` events)."""

    def __init__(self, message: MessageObject, input_tokens: int):
        self.message = message
        self.input_tokens = input_tokens
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type
        self.calls: set[int] = set()  # tool-call indexes already opened

    @staticmethod
    def error(body: dict) -> dict:
        """The stream's `error` event for an OpenAI-shaped error body (after the status line)."""
        return {"type": "error", "error": body["error"]}

    async def events(self, chunks: AsyncIterator[dict | None], finish_info
                     ) -> AsyncIterator[dict | None]:
        """Events in order; `finish_info()` gives (what ended the choice, cached prompt tokens,
        prompt tokens written under a new pin) once the chunks are done."""
        yield {"type": "message_start", "message": self.message.build(
            [], (None, None), usage(self.input_tokens, 0, 0))}
        output_tokens, finish = 0, None
        async for chunk in chunks:
            if chunk is None:
                yield None
                continue
            if chunk.get("usage") and not chunk["choices"]:
                output_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    for event in self._open("thinking", {"type": "thinking", "thinking": "",
                                                         "signature": ""}):
                        yield event
                    yield self._delta({"type": "thinking_delta",
                                       "thinking": delta["reasoning_content"]})
                if delta.get("content"):
                    for event in self._open("text", {"type": "text", "text": ""}):
                        yield event
                    yield self._delta({"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    if call["index"] not in self.calls:
                        self.calls.add(call["index"])
                        for event in self._open("tool_use", _tool_use(
                                call["id"], call["function"]["name"], {}), new=True):
                            yield event
                    fragment = (call.get("function") or {}).get("arguments") or ""
                    if fragment:
                        yield self._delta({"type": "input_json_delta", "partial_json": fragment})
                finish = choice["finish_reason"] or finish
        for event in self._close():
            yield event
        matched, cached, created = finish_info()
        reason = stop_reason(finish, matched, self.message.req.stop_sequences)
        yield {"type": "message_delta",
               "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
               "usage": {"output_tokens": output_tokens, "cache_read_input_tokens": cached,
                         "cache_creation_input_tokens": created}}
        yield {"type": "message_stop"}

    def _open(self, kind: str, block: dict, new: bool = False):
        if self.kind == kind and not new:
            return
        yield from self._close()
        self.index += 1
        self.kind = kind
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self):
        if self.kind is not None:
            if self.kind == "thinking":  # the client's block carries a signature field
                yield self._delta({"type": "signature_delta", "signature": ""})
            yield {"type": "content_block_stop", "index": self.index}
            self.kind = None

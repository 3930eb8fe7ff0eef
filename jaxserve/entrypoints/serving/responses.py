"""POST /v1/responses: OpenAI's Responses API, the subset agents use, served by the chat path.

A validated ResponsesRequest becomes a chat completion body (`chat_body`): `instructions` a
system message first; `input` text a user message, message items messages (text parts joined),
consecutive `function_call` items one assistant message with those `tool_calls`, each
`function_call_output` a `tool` message; `max_output_tokens`, `temperature`, `top_p`, function
`tools`, `tool_choice`, `parallel_tool_calls` and `text.format` (json_schema / json_object) their
chat equivalents. The chat path then does everything else (prompt, tools, constraints, limits),
and its answer, whole or streamed, is turned back into a `response` object or the Responses
event stream (`ResponseEvents`): a thinking model's `reasoning_content` becomes a `reasoning`
item (its text a `reasoning_text` part) before the message and calls. An error the chat path raises names the Responses field
(`rename_param`). Nothing is stored: ids are fresh, `store: true` and `previous_response_id` were
refused by the request model.

No I/O and no JAX: entrypoints/http/app.py owns the route.
"""

from __future__ import annotations

import secrets
from typing import Any, AsyncIterator

from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.serving import protocol

# Chat field -> the Responses field it came from, for error messages.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens",
           "response_format": "text.format", "stream_options": "stream"}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def rename_param(exc: InvalidRequest) -> InvalidRequest:
    """The chat path's error about a field, naming the Responses field instead."""
    param = exc.param or ""
    head = param.split(".")[0]
    if head not in _PARAMS:
        return exc
    new = _PARAMS[head] + param[len(head):]
    return type(exc)(str(exc).replace(f"'{param}", f"'{new}"), param=new)


def chat_body(req: Any) -> dict:
    """The chat completion body equivalent to a validated ResponsesRequest."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, dict):
            messages.append(item)
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
        else:
            content = item.content if isinstance(item.content, str) \
                else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name, value in (("max_completion_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p),
                        ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str) else
                               {"type": "function", "function": {"name": req.tool_choice.name}})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return body


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseObject:
    """The `response` object of one request: the echo of its settings, and its outcome."""

    def __init__(self, req: Any):
        self.req = req
        self.id = _id("resp")
        self.created_at = protocol.now()

    def build(self, status: str, output: list[dict], usage: dict | None = None,
              finish_reason: str | None = None) -> dict:
        req = self.req
        text = {"format": {"type": "text"}}
        if req.text is not None and req.text.format is not None:
            text = {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if finish_reason == "length"
                          else str(finish_reason)}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": req.model, "output": output, "usage": _usage(usage),
            "incomplete_details": incomplete, "error": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str)
                            else req.tool_choice.model_dump() if req.tool_choice is not None
                            else "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": text, "store": False, "previous_response_id": None, "metadata": {}}

    def from_chat(self, completion: dict) -> dict:
        """The whole response, from the chat completion body of the same request."""
        choice = completion["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        status = "completed" if finish in ("stop", "tool_calls") else "incomplete"
        output = []
        if message.get("reasoning_content") is not None:
            output.append(_reasoning_item(_id("rs"), message["reasoning_content"], status))
        if message.get("content"):
            output.append(_message_item(_id("msg"), message["content"], status))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], status))
        return self.build(status, output, completion["usage"], finish)


class ResponseEvents:
    """The chat path's streamed chunks -> the Responses event stream: response.created and
    .in_progress; per output item .output_item.added, its deltas (output_text.delta, or
    function_call_arguments.delta), their .done events and .output_item.done; then
    response.completed (or response.incomplete when max_output_tokens cut it), with usage. A
    thinking model's reasoning is an item of its own, first: .output_item.added, its
    reasoning_text.delta events, .reasoning_text.done, .output_item.done."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.sequence = 0
        self.output: list[dict] = []  # the items, as they stand
        self.open_message: int | None = None  # output index of the message being written
        self.open_reasoning: int | None = None  # output index of the reasoning being written
        self.calls: dict[int, int] = {}  # tool-call index -> output index
        self.open: list[int] = []  # output indexes not yet done

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def error(self, body: dict) -> dict:
        """The stream's `error` event for an error body (after the status line went out)."""
        return self._event("error", **{k: body["error"].get(k) for k in ("code", "message",
                                                                          "param")})

    async def events(self, chunks: AsyncIterator[dict | None]) -> AsyncIterator[dict | None]:
        """Events in order; None where a keep-alive should go out."""
        yield self._event("response.created", response=self.response.build("in_progress", []))
        yield self._event("response.in_progress",
                          response=self.response.build("in_progress", []))
        usage, finish = None, None
        async for chunk in chunks:
            if chunk is None:
                yield None
                continue
            if chunk.get("usage") and not chunk["choices"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    for event in self._reasoning(delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    for event in self._text(delta["content"]):
                        yield event
                for call in delta.get("tool_calls") or ():
                    for event in self._call(call):
                        yield event
                finish = choice["finish_reason"] or finish
        status = "completed" if finish in ("stop", "tool_calls") else "incomplete"
        for index in list(self.open):
            for event in self._close(index, status):
                yield event
        final = self.response.build(status, self.output, usage, finish)
        yield self._event(f"response.{status}", response=final)

    def _add(self, item: dict) -> tuple[int, dict]:
        index = len(self.output)
        self.output.append(item)
        self.open.append(index)
        return index, self._event("response.output_item.added", output_index=index,
                                  item={**item, "content": []}
                                  if item["type"] in ("message", "reasoning") else dict(item))

    def _reasoning(self, text: str):
        if self.open_reasoning is None:
            index, added = self._add(_reasoning_item(_id("rs"), "", "in_progress"))
            self.open_reasoning = index
            yield added
            yield self._event("response.content_part.added", item_id=self.output[index]["id"],
                              output_index=index, content_index=0,
                              part={"type": "reasoning_text", "text": ""})
        index = self.open_reasoning
        item = self.output[index]
        item["content"][0]["text"] += text
        yield self._event("response.reasoning_text.delta", item_id=item["id"],
                          output_index=index, content_index=0, delta=text)

    def _text(self, text: str):
        if self.open_reasoning is not None:  # the reasoning before the answer is complete
            yield from self._close(self.open_reasoning, "completed")
        if self.open_message is None:
            index, added = self._add(_message_item(_id("msg"), "", "in_progress"))
            self.open_message = index
            yield added
            yield self._event("response.content_part.added", item_id=self.output[index]["id"],
                              output_index=index, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})
        index = self.open_message
        item = self.output[index]
        item["content"][0]["text"] += text
        yield self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                          content_index=0, delta=text, logprobs=[])

    def _call(self, call: dict):
        if call["index"] not in self.calls:
            for index in (self.open_reasoning, self.open_message):  # complete before the calls
                if index is not None:
                    yield from self._close(index, "completed")
            index, added = self._add(_call_item(_id("fc"), call["id"],
                                                call["function"]["name"], "", "in_progress"))
            self.calls[call["index"]] = index
            yield added
        index = self.calls[call["index"]]
        fragment = (call.get("function") or {}).get("arguments") or ""
        if fragment:
            item = self.output[index]
            item["arguments"] += fragment
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=fragment)

    def _close(self, index: int, status: str):
        self.open.remove(index)
        item = self.output[index]
        item["status"] = status
        if item["type"] == "reasoning":
            self.open_reasoning = None
            part = item["content"][0]
            yield self._event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"])
            yield self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)
        elif item["type"] == "message":
            self.open_message = None
            part = item["content"][0]
            yield self._event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=index, item=dict(item))

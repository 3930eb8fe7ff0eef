"""POST /v1/responses: OpenAI's Responses API, served by the chat path, one model turn at a time.

A model turn of a validated ResponsesRequest is a chat completion body (`chat_body`):
`instructions` a system message first; the conversation's items (`input_items` of the request,
after those of its previous_response_id chain and of the run so far) as chat messages
(`chat_messages`: message items their text parts joined, consecutive `function_call` items one
assistant message with those `tool_calls`, each `function_call_output` a `tool` message, a
server tool's call and result a call and a `tool` message); `max_output_tokens`, `temperature`,
`top_p`, function `tools` and server tools (as functions), `tool_choice`, `parallel_tool_calls`
and `text.format` (json_schema / json_object) their chat equivalents. The chat path then does
everything else (prompt, tools, constraints, limits), and each turn's streamed answer is turned
into output items and the Responses event stream (`ResponseEvents`): a thinking model's
`reasoning_content` becomes a `reasoning` item (its text a `reasoning_text` part) before the
message and calls. An error the chat path raises names the Responses field (`rename_param`).
The run around the turns (steps, tools, storage) is agents/run.py's; response_runs.py drives it.

No I/O and no JAX.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from jaxserve.agents.file_search import citations
from jaxserve.agents.mcp_tools import (APPROVAL_REQUEST, APPROVAL_RESPONSE, CALL_ITEM, LIST_ITEM,
                                       call_text)
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


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                APPROVAL_RESPONSE: "mcpa", LIST_ITEM: "mcpl", CALL_ITEM: "mcp",
                APPROVAL_REQUEST: "mcpr"}
# A server tool's event between its .in_progress and .completed, as OpenAI's stream sends it.
RUNNING_EVENTS = {"file_search_call": "searching", "code_interpreter_call": "interpreting"}
# The server tool items whose failure OpenAI's stream says (.failed) rather than only ending them.
FAILED_EVENTS = frozenset({"mcp_call", "mcp_list_tools"})


def input_items(req: Any) -> list[dict]:
    """The request's `input` as Responses items (as GET .../input_items lists them)."""
    if isinstance(req.input, str):
        return as_items([{"type": "message", "role": "user", "content": req.input}])
    return as_items([item.model_dump(exclude_none=True) for item in req.input])


def as_items(raw: list[dict]) -> list[dict]:
    """Validated input items as stored items: each with an id, a message's content as parts."""
    items = []
    for item in raw:
        item.setdefault("type", "message")
        item.setdefault("id", _id(_ITEM_PREFIX[item["type"]]))
        if item["type"] == "message" and isinstance(item["content"], str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        items.append(item)
    return items


def chat_messages(items: list[dict], server_tools: dict | None = None,
                  tool_texts: dict[str, str] | None = None) -> list[dict]:
    """Responses items -> chat messages: a message's text parts joined; consecutive
    `function_call` items one assistant message with those `tool_calls`; a
    `function_call_output` a `tool` message; a server tool's call (`server_tools`: kind ->
    agents.tools.ServerTool) an assistant call of the function named by its kind and a `tool`
    message with what it returned (`tool_texts[item id]`, else read from the item); an MCP call
    alike (named by its tool), and an approval request the user denied as a call whose result
    says so (one approved is sent as its call; one unanswered, and MCP listings, not at all);
    reasoning items are not sent back."""
    messages: list[dict] = []
    by_item_type = {t.item_type: t for t in (server_tools or {}).values()
                    if t.item_type != CALL_ITEM}
    answers = {item["approval_request_id"]: item for item in items
               if item.get("type") == APPROVAL_RESPONSE}

    def call(call_id: str, name: str, arguments: str) -> None:
        entry = {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(entry)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})

    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            call(item["call_id"], item["name"], item["arguments"])
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
        elif kind == CALL_ITEM:
            call(item["id"], item["name"], item["arguments"])
            text = (tool_texts or {}).get(item["id"])
            messages.append({"role": "tool", "tool_call_id": item["id"],
                             "content": text if text is not None else call_text(item)})
        elif kind == APPROVAL_REQUEST:
            answer = answers.get(item["id"])
            if answer is not None and not answer["approve"]:
                call(item["id"], item["name"], item["arguments"])
                reason = f": {answer['reason']}" if answer.get("reason") else ""
                messages.append({"role": "tool", "tool_call_id": item["id"], "content":
                                 f"error: the user did not approve this call{reason}"})
        elif kind in by_item_type:
            tool = by_item_type[kind]
            call(item["id"], tool.kind, json.dumps(tool.arguments(item)))
            text = (tool_texts or {}).get(item["id"])
            messages.append({"role": "tool", "tool_call_id": item["id"],
                             "content": text if text is not None else tool.model_text(item)})
        elif kind == "message":
            parts = item["content"]
            if isinstance(parts, str):
                content = parts
            elif any("prompt_cache_breakpoint" in p for p in parts):
                # the parts stay apart: the chat path pins the prompt through a marked one
                content = [{"type": "text", "text": p["text"], **{
                    k: v for k, v in p.items() if k == "prompt_cache_breakpoint"}} for p in parts]
            else:
                content = "".join(p["text"] for p in parts)
            messages.append({"role": item["role"], "content": content})
    return messages


def chat_body(req: Any, items: list[dict] | None = None, server_tools: dict | None = None,
              tool_texts: dict[str, str] | None = None, tools_allowed: bool = True) -> dict:
    """The chat completion body of one model turn of a validated ResponsesRequest: the
    conversation `items` (default: its input), its function tools and `server_tools` (function
    name -> agents.tools.ServerTool) offered as functions (none when not `tools_allowed`)."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    messages += chat_messages(input_items(req) if items is None else items, server_tools,
                              tool_texts)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name, value in (("max_completion_tokens", req.max_output_tokens),
                        ("temperature", req.temperature), ("top_p", req.top_p),
                        ("parallel_tool_calls", req.parallel_tool_calls),
                        ("prompt_cache_key", req.prompt_cache_key)):
        if value is not None:
            body[name] = value
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in req.tools or () if t.type == "function"] if tools_allowed else []
    for name, tool in (server_tools or {}).items() if tools_allowed else ():
        tools.append({"type": "function", "function": {
            "name": name, "description": tool.description, "parameters": tool.parameters}})
    if tools:
        body["tools"] = tools
        if req.tool_choice is not None:
            body["tool_choice"] = (
                req.tool_choice if isinstance(req.tool_choice, str) else
                {"type": "function", "function": {"name": getattr(req.tool_choice, "name",
                                                                  req.tool_choice.type)}})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    if req.prompt_cache_options is not None:
        body["prompt_cache_options"] = req.prompt_cache_options.model_dump(exclude_none=True)
    body["stream"] = True  # a turn is read as its stream, whether the client streams or not
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
    """The `response` object of one request: the echo of its settings, and its outcome. `id` and
    `created_at` are given for a stored response built again (a resumed run)."""

    def __init__(self, req: Any, response_id: str | None = None,
                 created_at: int | None = None):
        self.req = req
        self.id = response_id or _id("resp")
        self.created_at = created_at if created_at is not None else protocol.now()

    def build(self, status: str, output: list[dict], usage: dict | None = None,
              finish_reason: str | None = None, error: dict | None = None) -> dict:
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
            "incomplete_details": incomplete, "error": error, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p,
            # An MCP tool's headers and token (credentials, as a rule) are not echoed.
            "tools": [t.model_dump(exclude_none=True, exclude={"headers", "authorization"})
                      for t in req.tools or ()],
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str)
                            else req.tool_choice.model_dump() if req.tool_choice is not None
                            else "auto"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "max_tool_calls": req.max_tool_calls, "background": bool(req.background),
            "text": text, "store": req.store is not False,
            "previous_response_id": req.previous_response_id,
            "conversation": None if req.conversation_id is None else {
                "id": req.conversation_id}, "metadata": {}}


class ResponseEvents:
    """A run's Responses event stream, every event numbered (`sequence_number`, from `sequence`
    on: a resumed run goes on from its last recorded event). `opening` (response.created and
    .in_progress, or .queued for a background run not started yet), then per model turn `turn`
    over the chat path's streamed chunks: per output item .output_item.added, its deltas
    (output_text.delta, or function_call_arguments.delta), their .done events and
    .output_item.done (a thinking model's reasoning is an item of its own, first: its
    reasoning_text.delta events, .reasoning_text.done); a server tool's call (`hidden`: the
    function names of the server tools) is not streamed as a function call but, once the run
    has made it its own item, by `tool_started` / `tool_done`; last `closing`:
    response.completed, .incomplete (max_output_tokens cut it, or the deadline), or .failed
    (failed or cancelled), with the whole response."""

    def __init__(self, response: ResponseObject, hidden: frozenset[str] = frozenset(),
                 sequence: int = 0):
        self.response = response
        self.hidden = hidden
        self.sequence = sequence
        # file id -> filename of the files file_search gave the model: an answer naming one
        # cites it (agents/file_search.citations)
        self.files: dict[str, str] = {}
        self.output: list[dict] = []  # the items, as they stand
        self.open_message: int | None = None  # output index of the message being written
        self.open_reasoning: int | None = None  # output index of the reasoning being written
        self.calls: dict[int, int] = {}  # tool-call index -> output index
        self.hidden_calls: dict[int, dict] = {}  # tool-call index -> a server tool's call
        self.open: list[int] = []  # output indexes not yet done
        # What the last `turn` produced: its output items, usage and finish reason.
        self.items: list[dict] = []
        self.usage: dict | None = None
        self.finish: str | None = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def error(self, body: dict) -> dict:
        """The stream's `error` event for an error body (after the status line went out)."""
        return self._event("error", **{k: body["error"].get(k) for k in ("code", "message",
                                                                          "param")})

    def opening(self, status: str = "in_progress") -> list[dict]:
        first = self._event("response.created", response=self.response.build(status, []))
        return [first, self.started()] if status == "in_progress" else [
            first, self._event("response.queued", response=self.response.build(status, []))]

    def started(self) -> dict:
        return self._event("response.in_progress",
                           response=self.response.build("in_progress", []))

    def closing(self, response: dict) -> dict:
        status = response["status"]
        kind = status if status in ("completed", "incomplete") else "failed"
        return self._event(f"response.{kind}", response=response)

    async def turn(self, chunks: AsyncIterator[dict | None]) -> AsyncIterator[dict | None]:
        """One model turn's events, None where a keep-alive should go out; after it, `items`,
        `usage` and `finish` say what the turn produced."""
        first = len(self.output)
        self.calls, self.hidden_calls = {}, {}
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
        self.items = self.output[first:] + [
            _call_item(_id("fc"), c["call_id"], c["name"], c["arguments"], status)
            for _, c in sorted(self.hidden_calls.items())]
        self.usage, self.finish = usage, finish

    async def events(self, chunks: AsyncIterator[dict | None]) -> AsyncIterator[dict | None]:
        """A response of one model turn: its events in order."""
        for event in self.opening():
            yield event
        async for event in self.turn(chunks):
            yield event
        status = "completed" if self.finish in ("stop", "tool_calls") else "incomplete"
        yield self.closing(self.response.build(status, self.output, self.usage, self.finish))

    def tool_started(self, item: dict) -> list[dict]:
        """A server tool's call begins: its item added (its output index is the next)."""
        index = len(self.output)
        self.output.append(item)
        kind = item["type"]
        events = [self._event("response.output_item.added", output_index=index, item=dict(item)),
                  self._event(f"response.{kind}.in_progress", item_id=item["id"],
                              output_index=index)]
        running = RUNNING_EVENTS.get(kind)  # OpenAI's stream says when the tool itself runs
        if running is not None:
            events.append(self._event(f"response.{kind}.{running}", item_id=item["id"],
                                      output_index=index))
        return events

    def tool_done(self, item: dict) -> list[dict]:
        index = next((i for i, it in enumerate(self.output) if it["id"] == item["id"]), None)
        if index is None:  # started before a restart: its events were sent then
            index = len(self.output)
            self.output.append(item)
        self.output[index] = item
        done = []  # numbered in the order they are sent
        if item["status"] == "completed" or (item["status"] == "failed"
                                             and item["type"] in FAILED_EVENTS):
            done.append(self._event(f"response.{item['type']}.{item['status']}",
                                    item_id=item["id"], output_index=index))
        done.append(self._event("response.output_item.done", output_index=index,
                                item=dict(item)))
        return done

    def added(self, item: dict) -> list[dict]:
        """An item complete as it is made (an MCP approval request)."""
        index = len(self.output)
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=index, item=dict(item)),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

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
        hidden = self.hidden_calls.get(call["index"])
        if hidden is None and call["index"] not in self.calls \
                and (call.get("function") or {}).get("name") in self.hidden:
            hidden = self.hidden_calls[call["index"]] = {
                "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
        if hidden is not None:  # a server tool's: the run makes it its own item
            hidden["arguments"] += (call.get("function") or {}).get("arguments") or ""
            return
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
            part["annotations"] = citations(part["text"], self.files) if self.files else []
            for n, annotation in enumerate(part["annotations"]):
                yield self._event("response.output_text.annotation.added", item_id=item["id"],
                                  output_index=index, content_index=0, annotation_index=n,
                                  annotation=annotation)
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

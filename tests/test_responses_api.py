"""Host-side pieces of the agent paths, without a model: a Responses request -> the chat body,
chat chunks -> the Responses event stream, and tool-call assembly of chat messages and deltas."""

from __future__ import annotations

import asyncio
import json

import pytest

from jaxserve.errors import InvalidRequest
from jaxserve.entrypoints.serving.request_models import request_models
from jaxserve.entrypoints.serving.responses import (ResponseEvents, ResponseObject, chat_body,
                                                    input_items, rename_param)
from jaxserve.entrypoints.serving.tool_output import ToolCallOutput
from jaxserve.entrypoints.serving.validation import validate
from jaxserve.tool_calling.parsers import get_tool_parser

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def responses(**fields):
    return validate(request_models().responses, {"model": "m", "input": "hi", **fields})


def test_chat_body_from_items_instructions_tools_and_format():
    req = responses(instructions="Be brief.", max_output_tokens=9, temperature=0, tools=[TOOL],
                    tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                    text={"format": {"type": "json_schema", "name": "x",
                                     "schema": {"type": "object"}}},
                    input=[{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
                           {"type": "function_call", "call_id": "c1", "name": "f",
                            "arguments": "{}"},
                           {"type": "function_call", "call_id": "c2", "name": "f",
                            "arguments": '{"x": 1}'},
                           {"type": "function_call_output", "call_id": "c1", "output": "1"},
                           {"type": "function_call_output", "call_id": "c2", "output": "2"}])
    body = chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "f",
                                                               "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    assert (body["max_completion_tokens"], body["temperature"], body["parallel_tool_calls"]) \
        == (9, 0, False)
    # Every model turn is read as its stream (with usage), whether the client streams or not.
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # A turn past max_tool_calls is offered no tool.
    assert "tools" not in chat_body(req, tools_allowed=False)


def test_input_items_and_a_conversation_with_a_server_tool_call():
    from jaxserve.agents.file_search import FileSearch

    req = responses(input="hi", tools=[{"type": "file_search", "vector_store_ids": ["docs"]}],
                    tool_choice={"type": "file_search"})
    (item,) = input_items(req)
    assert item["id"].startswith("msg_") and item["content"] == [{"type": "input_text",
                                                                 "text": "hi"}]
    tool = FileSearch(None)
    call = tool.item("fs_1", {"query": "cats"}, "completed",
                     [{"file_id": "d", "filename": "d.txt", "score": 1.0, "text": "Cats nap."}])
    body = chat_body(req, [item, call], {"file_search": tool})
    assert body["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "fs_1", "type": "function",
            "function": {"name": "file_search", "arguments": '{"query": "cats"}'}}]},
        {"role": "tool", "tool_call_id": "fs_1",
         "content": '[{"file_id": "d", "filename": "d.txt", "text": "Cats nap."}]'}]
    assert [t["function"]["name"] for t in body["tools"]] == ["file_search"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "file_search"}}


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "store": False}, "background"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"input": [{"type": "reasoning"}]}, "input"), ({"input": []}, "input"),
    ({"include": ["x"]}, "include"), ({"seed": 1}, "seed"),
])
def test_refused_fields_are_named(fields, param):
    with pytest.raises(InvalidRequest) as e:
        responses(**fields)
    assert e.value.param == param, str(e.value)


def test_chat_errors_name_the_responses_field():
    err = rename_param(InvalidRequest("'max_completion_tokens' must be at least 1",
                                      param="max_completion_tokens"))
    assert (err.param, str(err)) == ("max_output_tokens", "'max_output_tokens' must be at least 1")
    err = rename_param(InvalidRequest("'response_format': bad", param="response_format"))
    assert err.param == "text.format"
    same = InvalidRequest("x", param="temperature")
    assert rename_param(same) is same


def _chunk(delta=None, finish=None, usage=None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"choices": choices, "usage": usage}


def _events(chunks):
    async def source():
        for c in chunks:
            yield c

    async def collect(events):
        return [e async for e in events.events(source())]

    events = ResponseEvents(ResponseObject(responses(tools=[TOOL])))
    return asyncio.run(collect(events))


def test_text_then_calls_become_items_and_events():
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 0}}
    events = _events([
        _chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me "}), None,
        _chunk({"content": "check."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}},
                               {"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
        _chunk(usage=usage)])
    kinds = [e and e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", None, "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    numbered = [e for e in events if e is not None]
    assert [e["sequence_number"] for e in numbered] == list(range(len(numbered)))
    final = numbered[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 7
    message, first, second = final["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert (first["call_id"], first["arguments"]) == ("call_a", '{"a": 1}')
    assert (second["call_id"], second["arguments"]) == ("call_b", "{}")
    done = [e for e in numbered if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"a": 1}', "{}"]


def test_cut_by_max_output_tokens_is_incomplete():
    events = _events([_chunk({"content": "abc"}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


HERMES = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("text, finish, reason", [
    ("Sure. " + HERMES, "stop", "tool_calls"),
    ("Sure. " + HERMES + "\n" + HERMES, "length", "length"),
    ("no call here", "stop", "stop"),
])
def test_tool_call_messages_and_deltas_agree(text, finish, reason):
    output = ToolCallOutput(get_tool_parser("hermes"))
    message, got = output.message(text, finish)
    assert got == reason
    streamed = ToolCallOutput(get_tool_parser("hermes"))
    content, calls, last = "", {}, None
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        delta, last = streamed.delta(0, piece, finish if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", ()):
            call = calls.setdefault(d["index"], {"id": d.get("id"), "arguments": ""})
            call["arguments"] += d.get("function", {}).get("arguments", "")
    assert last == reason
    expected = message.get("tool_calls", [])
    assert [c["arguments"] for c in calls.values()] == [c["function"]["arguments"]
                                                        for c in expected]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert content.strip() == (message["content"] or "").strip()
    if expected:
        assert json.loads(expected[0]["function"]["arguments"]) == {"a": 1}


def test_without_a_parser_text_is_content():
    output = ToolCallOutput(None)
    assert output.message(HERMES, "stop") == ({"role": "assistant", "content": HERMES}, "stop")
    assert output.delta(0, "x", None) == ({"content": "x"}, None)
    assert output.delta(0, "", "stop") == ({}, "stop")


def test_tool_choice_decides_prompt_tools_constraint_and_special_tokens():
    from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
    from jaxserve.entrypoints.serving.protocol import parse_chat_request

    class Tokenizer:  # what choosing the parsers reads of a model's tokenizer
        chat_template = None

    def prepared(parser, **fields):
        serving = OpenAIServing(None, "m", tool_call_parser=parser)  # _tools needs no engine
        parsed = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                     "tools": [{"type": "function", "function": {"name": "f"}}],
                                     **fields})
        return serving._tools(parsed, Tokenizer())

    parsed, output = prepared("hermes", tool_choice="none")
    assert parsed.tools == () and output.parser is None
    parsed, output = prepared("hermes")  # auto: shown and parsed, not forced
    assert [t.name for t in parsed.tools] == ["f"] and output.parser.name == "hermes"
    assert parsed.sampling_params.structured_outputs is None
    parsed, _ = prepared("llama3_json", tool_choice="required")
    assert parsed.sampling_params.structured_outputs.param == "tools"
    assert parsed.sampling_params.skip_special_tokens
    parsed, _ = prepared("mistral")
    assert not parsed.sampling_params.skip_special_tokens  # [TOOL_CALLS] must stay in the text


def test_reasoning_becomes_a_reasoning_item_first():
    events = _events([_chunk({"role": "assistant", "content": ""}),
                      _chunk({"reasoning_content": "Two plus "}),
                      _chunk({"reasoning_content": "two."}), _chunk({"content": "4"}, "stop")])
    kinds = [e["type"] for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    reasoning, message = events[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two plus two."}]
    assert message["content"][0]["text"] == "4"
    assert events[-1]["response"]["status"] == "completed"

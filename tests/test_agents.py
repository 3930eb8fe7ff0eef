"""What agent clients send, against a real server on SmolLM2 with the official `openai` client:
structured outputs (parse() with a pydantic model, json_object, strict json_schema, regex,
choice), tool calling (tool_choice required / named, streamed and not, a multi-turn exchange with
a tool result), POST /v1/responses with and without a function tool, continuous usage stats, and
bad constraints as 400s naming the field. One module-scoped server; greedy and short outputs."""
# The tests take the fixtures imported from test_server as arguments:
# ruff: noqa: F811

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Annotated

import jsonschema
import openai
import pydantic
import pytest

from jaxserve.entrypoints.serving.logprobs import MIN_LOGPROB
# test_server's module fixtures: a server on SmolLM2 (strict compile; no compile while serving
# and no leaked page at teardown), built afresh for this module.
from tests.test_server import SMOLLM2, client, engine, http_post, server  # noqa: F401

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---------------------------------------------------------------- structured outputs


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Unit
    highs: list[Annotated[int, pydantic.Field(ge=-50, le=60)]] = pydantic.Field(max_length=3)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=SMOLLM2, messages=[{"role": "user", "content": "The forecast for Rome as JSON."}],
        response_format=Forecast, temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Forecast)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "role", "address", "tags"],
    "additionalProperties": False,
}


def test_strict_json_schema_nested_objects_arrays_enums(client):
    r = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Describe a user as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}},
        n=3, seed=7, temperature=0.8, max_tokens=160)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_with_logprobs_clamped(server):
    """Grammar-masked tokens have logprob -inf, which JSON has no word for: the body must still
    be valid JSON (the raw text is parsed strictly), with such logprobs clamped."""
    r = http_post(f"{server.url}/v1/chat/completions", {
        "model": SMOLLM2, "messages": [{"role": "user", "content": "A JSON object, please."}],
        "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 60,
        "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    body = json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} in the body"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    values = [t["logprob"] for t in choice["logprobs"]["content"]]
    values += [top["logprob"] for t in choice["logprobs"]["content"] for top in t["top_logprobs"]]
    assert all(math.isfinite(v) and v >= MIN_LOGPROB for v in values)
    assert MIN_LOGPROB in values  # a forced token leaves the other top entries masked


def test_regex_and_choice_on_chat_and_completions(client):
    date = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "When did WW2 end?"}],
        temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert date.choices[0].finish_reason == "stop"
    text = date.choices[0].message.content
    assert len(text) == 10 and text[4] == text[7] == "-" and text.replace("-", "").isdigit()
    mood = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Is 'I love it' positive?"}],
        temperature=0, max_tokens=10, extra_body={"guided_choice": ["positive", "negative"]})
    assert mood.choices[0].message.content in ("positive", "negative")
    code = client.completions.create(model=SMOLLM2, prompt="Three digits:", temperature=0,
                                     max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"})
    assert code.choices[0].text.isdigit() and len(code.choices[0].text) == 3


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "this is not a grammar"}, "guided_grammar"),
    ({"guided_json": {"type": "object", "properties": 3}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    for stream in (False, True):  # a 400 before the stream starts, not an error inside a 200
        r = http_post(f"{server.url}/v1/chat/completions", {
            "model": SMOLLM2, "messages": ASK_WEATHER, "max_tokens": 8, "stream": stream,
            **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------- tool calling


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_not_streamed(client):
    required = client.chat.completions.create(
        model=SMOLLM2, messages=ASK_WEATHER, tools=[WEATHER, ADD], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather", "add"})
    named = client.chat.completions.create(
        model=SMOLLM2, messages=ASK_WEATHER, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0,
        max_tokens=80)
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"add"})
    assert len(choice.message.tool_calls) == 1


def test_tool_choice_required_and_named_streamed(client):
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        calls: dict[int, dict] = {}
        finish = None
        with client.chat.completions.create(
                model=SMOLLM2, messages=ASK_WEATHER, tools=[WEATHER, ADD],
                tool_choice=tool_choice, parallel_tool_calls=False, temperature=0,
                max_tokens=80, stream=True) as stream:
            for chunk in stream:
                for choice in chunk.choices:
                    assert not choice.delta.content
                    for d in choice.delta.tool_calls or ():
                        call = calls.setdefault(d.index, {"id": d.id, "name": "", "args": ""})
                        assert d.id in (None, call["id"])  # the id comes once, first
                        call["name"] += (d.function.name or "") if d.function else ""
                        call["args"] += (d.function.arguments or "") if d.function else ""
                    finish = choice.finish_reason or finish
        assert finish == "tool_calls" and list(calls) == [0]
        call = calls[0]
        assert call["id"].startswith("call_")
        assert call["name"] in ({"get_weather", "add"} if tool_choice == "required"
                                else {"get_weather"})
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])


def test_multi_turn_with_a_tool_result(client):
    """The agent loop: the model calls, the client runs the tool and sends the result back; the
    next turn sees the whole history (prompt grows by the call and the result) and answers."""
    first = client.chat.completions.create(
        model=SMOLLM2, messages=ASK_WEATHER, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        max_tokens=80)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK_WEATHER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=SMOLLM2, messages=history, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls, choice.message
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20
    # Without the tools the same history still renders (the call and the result as text).
    plain = client.chat.completions.create(model=SMOLLM2, messages=history, temperature=0,
                                           max_tokens=8)
    assert plain.choices[0].message.content


def test_continuous_usage_stats_on_every_chunk(client):
    seen = []
    for chunk in client.chat.completions.create(
            model=SMOLLM2, messages=ASK_WEATHER, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}):
        assert chunk.usage is not None
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == 12 and len(seen) > 3


# ---------------------------------------------------------------- /v1/responses


def test_responses_text_and_streamed_events(client):
    r = client.responses.create(model=SMOLLM2, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", temperature=0,
                                max_output_tokens=24)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text and r.output[0].type == "message"
    assert r.usage.output_tokens <= 24 and r.usage.input_tokens > 5
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    with client.responses.stream(
            model=SMOLLM2, input=[{"role": "user", "content": "The capital of France?"}],
            temperature=0, max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                             "strict": True}}) as stream:
        events = [e for e in stream]
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    jsonschema.validate(json.loads(final.output_text), schema)


def test_responses_function_tool_round_trip(client):
    tool = {"type": "function", "name": "get_weather",
            "description": WEATHER["function"]["description"],
            "parameters": SCHEMAS["get_weather"]}
    r = client.responses.create(model=SMOLLM2, input="What is the weather in Paris?",
                                tools=[tool], tool_choice={"type": "function",
                                                           "name": "get_weather"},
                                temperature=0, max_output_tokens=80)
    assert r.status == "completed"
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    # Streamed, the arguments arrive as deltas that join to the .done event's.
    with client.responses.stream(model=SMOLLM2, input="What is the weather in Paris?",
                                 tools=[tool], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=80) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas
    # The tool's result goes back as input; the model answers in text.
    follow = client.responses.create(model=SMOLLM2, temperature=0, max_output_tokens=30,
                                     tools=[tool], input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": json.dumps({"temperature": 18, "sky": "sunny"})}])
    assert follow.output_text and follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    # (store, background and chains are served: tests/test_responses_store.py)
    ({"store": False, "background": True}, "background"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
     "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_refusals_name_the_field(server, body, param):
    r = http_post(f"{server.url}/v1/responses", {"model": SMOLLM2, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text

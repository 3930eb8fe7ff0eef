"""OpenAI's strict mode: a strict json_schema response format, or a strict function tool, has its
objects closed (jaxserve.structured.strict), so the grammar refuses properties the schema never
names; a schema that says additionalProperties keeps what it says."""

from __future__ import annotations

from jaxserve.entrypoints.serving.protocol import parse_chat_request
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.structured.strict import close_objects
from jaxserve.tool_calling.choice import forced_tool_call
from jaxserve.tool_calling.functions import parse_tool_choice, parse_tools
from jaxserve.tool_calling.parsers import get_tool_parser
# test_tool_calling's fixtures (SmolLM2's tokenizer and its grammar compiler) and matcher helper:
# ruff: noqa: F811
from tests.test_tool_calling import grammar_accepts, smollm2_grammars, smollm2_tok  # noqa: F401

COUNTRY = {"type": "object", "properties": {
    "name": {"type": "string"},
    "capital": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cities": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}}}},
    "leader": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/person"}]},
    "extra": {"type": "object", "additionalProperties": {"type": "integer"}}},
    "required": ["name"],
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}}}}}


def test_close_objects_closes_every_object_that_does_not_say():
    closed = close_objects(COUNTRY)
    assert "additionalProperties" not in COUNTRY  # the input is not changed
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["capital"]["additionalProperties"] is False
    assert props["cities"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["person"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] == {"type": "integer"}  # said: kept
    assert "additionalProperties" not in props["name"]  # not an object
    # allOf parts stay as written (closing each would leave only {}); what they nest closes.
    parts = close_objects({"allOf": [{"type": "object", "properties": {"a": {
        "type": "object"}}}, {"properties": {"b": {"type": "string"}}}]})
    assert "additionalProperties" not in parts and all(
        "additionalProperties" not in p for p in parts["allOf"])
    assert parts["allOf"][0]["properties"]["a"]["additionalProperties"] is False


def _response_format(strict: bool | None) -> SO:
    fmt = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "response_format": fmt}).sampling_params.structured_outputs


def test_strict_response_format_refuses_unnamed_properties(smollm2_grammars):
    good = '{"name": "France", "capital": {"city": "Paris"}}'
    extra = '{"name": "France", "official_language": "French"}'
    nested = '{"name": "France", "capital": {"city": "Paris", "mayor": "x"}}'
    strict = _response_format(True)
    assert grammar_accepts(smollm2_grammars, strict, good)
    assert not grammar_accepts(smollm2_grammars, strict, extra) and not grammar_accepts(smollm2_grammars, strict, nested)
    assert grammar_accepts(smollm2_grammars, strict, '{"name": "France", "extra": {"k": 1}}')
    for loose in (_response_format(False), _response_format(None)):  # JSON Schema's own rule
        assert grammar_accepts(smollm2_grammars, loose, extra) and grammar_accepts(smollm2_grammars, loose, nested)


def test_strict_tool_closes_forced_call_arguments(smollm2_grammars):
    params = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    parser = get_tool_parser("hermes")
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {a}}}\n</tool_call>'
    for strict in (True, False):
        tools = parse_tools([{"type": "function", "function": {
            "name": "get_weather", "parameters": params, "strict": strict}}])
        forced = forced_tool_call(tools, parse_tool_choice("required", tools), parser,
                                  parallel_tool_calls=False)
        assert grammar_accepts(smollm2_grammars, forced, call.format(a='{"city": "Paris"}'))
        assert grammar_accepts(smollm2_grammars, forced, call.format(a='{"city": "Paris", "day": "Monday"}')) \
            is not strict

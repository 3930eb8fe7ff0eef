"""OpenAI's strict mode: a strict json_schema response format, or a strict function tool, has its
objects closed (jaxserve.structured.strict), so the grammar refuses properties the schema never
names; a schema that says additionalProperties keeps what it says."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.serving.protocol import parse_chat_request
from jaxserve.structured import StructuredOutputsParams as SO
from jaxserve.structured.grammar import GrammarViolation
from jaxserve.structured.strict import close_objects
from jaxserve.tokenizer import Tokenizer
from jaxserve.tool_calling.choice import forced_tool_call
from jaxserve.tool_calling.functions import parse_tool_choice, parse_tools
from jaxserve.tool_calling.parsers import get_tool_parser

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


@pytest.fixture(scope="module")
def grammars(smollm2_path):
    from jaxserve.structured.grammar import GrammarCompiler

    tok = Tokenizer.from_gguf(smollm2_path)
    return tok, GrammarCompiler(tok, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


def _accepts(grammars, constraint: SO, text: str) -> bool:
    tok, compiler = grammars
    matcher = compiler.compile(constraint).matcher(constraint.param)
    try:
        for t in tok.encode(text, add_special_tokens=False):
            matcher.accept(t)
    except GrammarViolation:
        return False
    return matcher.is_accepting


def _response_format(strict: bool | None) -> SO:
    fmt = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "response_format": fmt}).sampling_params.structured_outputs


def test_strict_response_format_refuses_unnamed_properties(grammars):
    good = '{"name": "France", "capital": {"city": "Paris"}}'
    extra = '{"name": "France", "official_language": "French"}'
    nested = '{"name": "France", "capital": {"city": "Paris", "mayor": "x"}}'
    strict = _response_format(True)
    assert _accepts(grammars, strict, good)
    assert not _accepts(grammars, strict, extra) and not _accepts(grammars, strict, nested)
    assert _accepts(grammars, strict, '{"name": "France", "extra": {"k": 1}}')
    for loose in (_response_format(False), _response_format(None)):  # JSON Schema's own rule
        assert _accepts(grammars, loose, extra) and _accepts(grammars, loose, nested)


def test_strict_tool_closes_forced_call_arguments(grammars):
    params = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    parser = get_tool_parser("hermes")
    call = '<tool_call>\n{{"name": "get_weather", "arguments": {a}}}\n</tool_call>'
    for strict in (True, False):
        tools = parse_tools([{"type": "function", "function": {
            "name": "get_weather", "parameters": params, "strict": strict}}])
        forced = forced_tool_call(tools, parse_tool_choice("required", tools), parser,
                                  parallel_tool_calls=False)
        assert _accepts(grammars, forced, call.format(a='{"city": "Paris"}'))
        assert _accepts(grammars, forced, call.format(a='{"city": "Paris", "day": "Monday"}')) \
            is not strict

"""OpenAI request parsing (no engine, no I/O): every field is used or rejected with a 400 that
names it; known fields we do not implement pass only at their neutral value; the request limits;
hostile JSON (lone surrogates, deep nesting); and any JSON value at all parses or is a typed 4xx."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import RequestLimits
from jaxserve.errors import ConfigError, InvalidRequest, error_status
from jaxserve.entrypoints.serving.protocol import parse_chat_request, parse_completion_request
from jaxserve.entrypoints.serving.request_models import request_models
from jaxserve.entrypoints.serving.validation import load_json

MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields):
    return parse_chat_request({"model": "m", "messages": MSGS, **fields})


def completion(**fields):
    return parse_completion_request({"model": "m", "prompt": "Hi", **fields})


def test_chat_defaults_and_fields():
    r = chat()
    assert (r.kind, r.model, r.prompts, r.stream, r.include_usage, r.echo, r.logprobs) == (
        "chat", "m", [MSGS], False, False, False, None)
    assert not r.max_tokens_given  # the server fills it from the context left
    assert r.sampling_params.temperature == 1.0 and r.sampling_params.n == 1
    assert r.sampling_params.max_tokens is None
    assert chat(min_tokens=40).sampling_params.min_tokens == 40  # no max_tokens to exceed
    r = chat(max_tokens=5, max_completion_tokens=7, n=2, temperature=0.5, top_p=0.9, seed=3,
             stop="x", presence_penalty=0.1, frequency_penalty=0.2, top_k=4, min_p=0.1,
             repetition_penalty=1.1, ignore_eos=True, min_tokens=2, stop_token_ids=[5],
             skip_special_tokens=False, include_stop_str_in_output=True, stream=True,
             stream_options={"include_usage": True}, logprobs=True, top_logprobs=4)
    p = r.sampling_params
    assert r.max_tokens_given and p.max_tokens == 7  # max_completion_tokens wins
    assert (p.n, p.temperature, p.top_p, p.seed, p.stop) == (2, 0.5, 0.9, 3, ("x",))
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p) == (0.1, 0.2, 4, 0.1)
    assert (p.repetition_penalty, p.ignore_eos, p.min_tokens, p.stop_token_ids) == (
        1.1, True, 2, (5,))
    assert (p.skip_special_tokens, p.include_stop_str_in_output) == (False, True)
    assert (r.stream, r.include_usage, r.logprobs, p.logprobs) == (True, True, 4, 4)
    assert chat(logprobs=True).logprobs == 0  # the sampled token's logprob, no alternatives


def test_chat_messages():
    parts = [{"role": "system", "content": [{"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}]},
             {"role": "developer", "content": "d"}, {"role": "assistant", "content": "c"},
             {"role": "user", "content": "u"}]
    assert chat(messages=parts).prompts == [[
        {"role": "system", "content": "ab"}, {"role": "developer", "content": "d"},
        {"role": "assistant", "content": "c"}, {"role": "user", "content": "u"}]]
    for bad in ([], "hi", [{"content": "x"}], [{"role": "tool", "content": "x"}],
                [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]):
        with pytest.raises(InvalidRequest) as e:
            chat(messages=bad)
        assert e.value.param == "messages"


def test_completion_prompts_and_fields():
    assert completion().prompts == ["Hi"]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    r = completion()
    assert r.max_tokens_given and r.sampling_params.max_tokens == 16  # OpenAI's default
    r = completion(logprobs=3)
    assert r.logprobs == 3 and r.sampling_params.logprobs == 3
    assert completion(echo=True).echo
    # Per-request speculation: 0 opts out; up to 15 (the largest K a server can run) passes.
    assert completion().sampling_params.num_speculative_tokens is None
    assert completion(num_speculative_tokens=0).sampling_params.num_speculative_tokens == 0
    assert chat(num_speculative_tokens=15).sampling_params.num_speculative_tokens == 15
    for bad in ("", [], [""], ["a", 1], [[1], "a"], [1, True], {"text": "a"}, 5):
        with pytest.raises(InvalidRequest) as e:
            completion(prompt=bad)
        assert e.value.param == "prompt"


@pytest.mark.parametrize("parse, fields, param", [
    (chat, {"temperature": -1}, "temperature"),
    (chat, {"top_p": 2}, "top_p"),
    (chat, {"n": 0}, "n"),
    (chat, {"max_tokens": -5}, "max_tokens"),
    (chat, {"max_tokens": True}, "max_tokens"),
    (chat, {"max_completion_tokens": 1.5}, "max_completion_tokens"),
    (chat, {"seed": "x"}, "seed"),
    (chat, {"stop": [""]}, "stop"),
    (chat, {"stop": ["a"] * 17}, "stop"),
    (chat, {"stop": 3}, "stop"),
    (chat, {"stream": "yes"}, "stream"),
    (chat, {"stream_options": {"include_usage": True}}, "stream_options"),
    (chat, {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    (chat, {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    (chat, {"logprobs": 2}, "logprobs"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"echo": True}, "echo"),  # a completions field
    (chat, {"frobnicate": 1}, "frobnicate"),
    (chat, {"logit_bias": {"1": 2}}, "logit_bias"),
    (chat, {"tools": [{"type": "function"}]}, "tools"),
    (chat, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    (chat, {"tool_choice": "required"}, "tool_choice"),
    (chat, {"tool_choice": "auto", "tools": [TOOL], "response_format": {"type": "xml"}},
     "response_format"),
    (chat, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    (chat, {"tools": [TOOL], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    (chat, {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    (chat, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    (chat, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    (chat, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (chat, {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    (chat, {"guided_choice": []}, "guided_choice"),
    (chat, {"guided_json": "{not json"}, "guided_json"),
    (chat, {"messages": [{"role": "tool", "content": "3"}]}, "messages"),
    (chat, {"messages": [{"role": "user", "content": None}]}, "messages"),
    (chat, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    (chat, {"best_of": 3}, "best_of"),
    (chat, {"store": True}, "store"),
    (chat, {"parallel_tool_calls": 1}, "parallel_tool_calls"),
    (completion, {"response_format": {"type": "json_object"}}, "response_format"),
    (completion, {"tools": [TOOL]}, "tools"),
    (chat, {"user": 5}, "user"),
    (chat, {"model": None}, "model"),
    (completion, {"logprobs": 21}, "logprobs"),
    (completion, {"logprobs": True}, "logprobs"),
    (completion, {"echo": 1}, "echo"),
    (completion, {"max_tokens": 0}, "max_tokens"),  # scoring only is for echo
    (completion, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (completion, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (chat, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (completion, {"suffix": "x"}, "suffix"),
    (completion, {"messages": MSGS}, "messages"),  # a chat field
    (completion, {"max_completion_tokens": 3}, "max_completion_tokens"),
    (completion, {"num_speculative_tokens": -1}, "num_speculative_tokens"),
    (chat, {"num_speculative_tokens": 16}, "num_speculative_tokens"),
    (chat, {"num_speculative_tokens": "0"}, "num_speculative_tokens"),
])
def test_rejections_name_the_field(parse, fields, param):
    with pytest.raises(InvalidRequest) as e:
        parse(**fields)
    assert e.value.param == param, str(e.value)


def test_neutral_values_pass():
    chat(logit_bias={}, tools=[], tool_choice="none", functions=[], function_call="none",
         response_format={"type": "text"}, user="alice", store=False, metadata=None,
         parallel_tool_calls=None, service_tier=None, n=2, best_of=2, reasoning_effort=None)
    completion(suffix="", best_of=1, logit_bias=None, user=None)


@pytest.mark.parametrize("fields, kind, param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}}, "json", "response_format"),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json", "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "grammar", "structured_outputs"),
    ({"guided_json": '{"type": "string"}'}, "json", "guided_json"),
    ({"guided_regex": "[a-z]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, "grammar", "guided_grammar"),
])
def test_structured_output_fields_become_one_constraint(fields, kind, param):
    for parse in (chat, completion):
        if "response_format" in fields and parse is completion:
            continue
        constraint = parse(**fields).sampling_params.structured_outputs
        assert (constraint.kind, constraint.param) == (kind, param)
    assert chat(response_format={"type": "text"}).sampling_params.structured_outputs is None


def test_tools_tool_choice_and_tool_messages():
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    req = chat(messages=history, tools=[TOOL], parallel_tool_calls=False,
               tool_choice={"type": "function", "function": {"name": "f"}})
    assert [t.name for t in req.tools] == ["f"] and req.parallel_tool_calls is False
    assert (req.tool_choice.mode, req.tool_choice.name) == ("named", "f")
    assert req.prompts[0][-2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert req.prompts[0][-1] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}
    assert chat(tools=[TOOL]).tool_choice.mode == "auto"
    assert chat().tool_choice.mode == "none"


def test_continuous_usage_needs_include_usage():
    on = {"include_usage": True, "continuous_usage_stats": True}
    assert chat(stream=True, stream_options=on).continuous_usage
    assert not chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage


def test_body_must_be_an_object():
    for body in ([], "x", None, 3):
        with pytest.raises(InvalidRequest, match="JSON object"):
            parse_chat_request(body)


# ---------------------------------------------------------------- request limits


@pytest.mark.parametrize("parse, fields, param", [
    (chat, {"n": 129}, "n"),
    (chat, {"n": 1_000_000}, "n"),
    (chat, {"n": 129, "best_of": 129}, "n"),
    (completion, {"best_of": 200}, "best_of"),
    (completion, {"prompt": ["a"] * 129}, "prompt"),
    (completion, {"prompt": [[1]] * 129}, "prompt"),
    (chat, {"stop": ["s"] * 17}, "stop"),
    (chat, {"stop": "x" * 257}, "stop"),
    (chat, {"stop": ["ok", "x" * 257]}, "stop"),
    (chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (chat, {"messages": MSGS * 1025}, "messages"),
])
def test_default_limits_name_the_field(parse, fields, param):
    with pytest.raises(InvalidRequest) as e:
        parse(**fields)
    assert e.value.param == param, str(e.value)


def test_limits_are_configurable_and_shape_the_schema():
    limits = RequestLimits(max_n=4, max_prompts=2, max_stop=1, max_stop_length=3,
                           max_logprobs=2, max_messages=2)
    body = {"model": "m", "messages": MSGS}
    assert parse_chat_request({**body, "n": 4}, limits).sampling_params.n == 4
    for fields, param in [({"n": 5}, "n"), ({"stop": ["a", "b"]}, "stop"),
                          ({"stop": "abcd"}, "stop"), ({"messages": MSGS * 3}, "messages"),
                          ({"logprobs": True, "top_logprobs": 3}, "top_logprobs")]:
        with pytest.raises(InvalidRequest) as e:
            parse_chat_request({**body, **fields}, limits)
        assert e.value.param == param
    with pytest.raises(InvalidRequest, match=r"'logprobs' must be in \[0, 2\]"):
        parse_completion_request({"model": "m", "prompt": "a", "logprobs": 3}, limits)
    with pytest.raises(InvalidRequest) as e:
        parse_completion_request({"model": "m", "prompt": ["a", "b", "c"]}, limits)
    assert e.value.param == "prompt" and "at most 2" in str(e.value)
    # The published schema carries the same numbers: one definition for both.
    schema = request_models(limits).chat.model_json_schema()
    assert {"maximum": 4, "type": "integer"} in schema["properties"]["n"]["anyOf"]
    assert schema["properties"]["messages"]["maxItems"] == 2
    with pytest.raises(ConfigError):
        RequestLimits(max_logprobs=21)  # the sampler's compiled width
    with pytest.raises(ConfigError):
        RequestLimits(max_n=0)


# ---------------------------------------------------------------- hostile JSON


def test_lone_surrogates_nesting_and_non_json_numbers_are_400s():
    body = json.dumps({"model": "m", "prompt": ["fine", "\ud800 not unicode"]})
    assert "\\ud800" in body  # valid JSON: the escape is legal, the text it makes is not
    with pytest.raises(InvalidRequest, match="not valid Unicode") as e:
        load_json(body, 64)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="not valid Unicode") as e:
        load_json('{"\\udc00": 1}', 64)  # a key
    assert e.value.param is None
    for deep in ("[" * 5000 + "]" * 5000, '{"a": ' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(InvalidRequest, match="nests deeper than 64"):
            load_json(deep, 64)
    assert load_json("[" * 64 + "]" * 64, 64) == functools.reduce(lambda x, _: [x], range(63), [])
    with pytest.raises(InvalidRequest, match="nests deeper than 3") as e:
        load_json('{"messages": [{"content": [1]}]}', 3)
    assert e.value.param == "messages"
    for text in ('{"temperature": NaN}', '{"n": Infinity}', '{"seed": ' + "9" * 5000 + "}",
                 b"\xff\xfe{", "{not json"):
        with pytest.raises(InvalidRequest, match="malformed JSON"):
            load_json(text, 64)


# ---------------------------------------------------------------- property: any JSON value


_SCALARS = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
            | st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "", "user"]))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def _near_valid(model, base: dict) -> st.SearchStrategy:
    """A valid body with a few of the model's own fields set to arbitrary values: past the
    unknown-field check into each field's validation, and on into SamplingParams."""
    return st.dictionaries(st.sampled_from(sorted(model.model_fields)), _JSON,
                           max_size=3).map(lambda d: {**base, **d})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["chat", "completion"]), body=st.one_of(
    _JSON, _near_valid(request_models().chat, {"model": "m", "messages": MSGS}),
    _near_valid(request_models().completion, {"model": "m", "prompt": "Hi"})))
def test_any_json_is_a_parsed_request_or_a_typed_4xx(kind, body):
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    try:
        parsed = parse(load_json(json.dumps(body), 64))
    except InvalidRequest as e:  # ContextLengthExceeded included
        assert 400 <= error_status(e).http < 500 and str(e)
        assert e.param is None or isinstance(e.param, str)
        return
    assert parsed.kind == kind and parsed.prompts and parsed.sampling_params.n >= 1

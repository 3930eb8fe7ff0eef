"""Tool calling building blocks: tools/tool_choice validation, the parsers on fixed texts (whole
and streamed in pieces, which must agree), forced-call grammars, tools in the chat prompt."""

from __future__ import annotations

import json

import pytest

from jaxserve.errors import ConfigError, InvalidRequest, TokenizerError
from jaxserve.structured.grammar import GrammarViolation
from jaxserve.tokenizer import Tokenizer, read_chat_template
from jaxserve.tool_calling.choice import forced_tool_call
from jaxserve.tool_calling.functions import parse_tool_choice, parse_tools
from jaxserve.tool_calling.parsers import TOOL_PARSERS, get_tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

W1 = '{"city": "Paris", "unit": "C"}'
W2 = '{"city": "Tokyo \\"Japan\\"", "nested": {"k": [1, {"x": "}"}]}}'

# (parser, generated text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W1}}}\n</tool_call>',
     None, [("get_weather", W1)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W1}}}\n'
               f'</tool_call>\n<tool_call>\n{{"arguments": {W2}, "name": "get_weather"}}'
               f'\n</tool_call>', "Let me check.", [("get_weather", W1), ("get_weather", W2)]),
    # an unclosed last block still counts once its JSON is complete; no arguments is {}
    ("hermes", '<tool_call>\n{"name": "add"}', None, [("add", "{}")]),
    ("hermes", 'Paris is sunny <b>today</b>.', 'Paris is sunny <b>today</b>.', []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2}"}\n</tool_call>', None,
     [("add", '{"a": 2}')]),  # arguments sent as a JSON string
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W1}}}', None,
     [("get_weather", W1)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {W1}}}; '
                    f'{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}', None,
     [("get_weather", W1), ("add", '{"a": 1, "b": 2}')]),
    ("llama3_json", 'The answer is {"name": "x"}.', 'The answer is {"name": "x"}.', []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W1}}}, '
                f'{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]', None,
     [("get_weather", W1), ("add", '{"a": 1, "b": 2}')]),
    ("mistral", f'Sure. [TOOL_CALLS]get_weather[ARGS]{W1}[TOOL_CALLS]add[ARGS]{{"a": 3}}',
     "Sure.", [("get_weather", W1), ("add", '{"a": 3}')]),
    ("mistral", 'No [TOOLS] needed [here].', 'No [TOOLS] needed [here].', []),
    ("phi4_mini_json", f'functools[{{"name": "get_weather", "arguments": {W1}}}, '
                       f'{{"name": "add", "arguments": {{"a": 1}}}}]', None,
     [("get_weather", W1), ("add", '{"a": 1}')]),
    ("phi4_mini_json", f'I will call it. functools[{{"name": "add", "arguments": {W2}}}]',
     "I will call it.", [("add", W2)]),
    ("phi4_mini_json", 'Use functools.partial here.', 'Use functools.partial here.', []),
]

# Malformed calls: the whole text is content and there are no calls (a stream has announced
# what it saw by then; its finish_reason is "length" or the output is the model's fault).
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}'),  # unfinished
    ("hermes", '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>'),  # not an object
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} trailing'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {}} {"name": "f"}]'),
    ("mistral", '[TOOL_CALLS]add[ARGS]"x"'),
    ("phi4_mini_json", 'functools[{"name": "add", "arguments": {}} {"name": "f"}]'),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse_and_stream_agree(parser, text, content, calls):
    p = get_tool_parser(parser)
    parsed = p.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    # OpenAI's id shape; Mistral's templates take only 9 letters and digits
    id_ok = (lambda i: i.isalnum() and len(i) == 9) if parser == "mistral" else (
        lambda i: i.startswith("call_") and len(i) == 29)
    assert all(id_ok(c.id) for c in parsed.tool_calls)
    for c in parsed.tool_calls:
        assert c.to_openai()["function"] == {"name": c.name, "arguments": c.arguments}
        json.loads(c.arguments)
    for step in (1, 2, 3, 7, len(text)):  # streamed in pieces of every size
        stream = p.stream()
        deltas = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        deltas.append(stream.finish())
        streamed_content = "".join(d.content for d in deltas)
        assembled: dict[int, dict] = {}
        for d in deltas:
            assert len({e["index"] for e in d.tool_calls}) == len(d.tool_calls)
            for e in d.tool_calls:
                call = assembled.setdefault(e["index"], {"arguments": ""})
                if "id" in e:  # the first delta of a call: id, type and name, once
                    assert "id" not in call and e["type"] == "function"
                    assert id_ok(e["id"])
                    call.update(id=e["id"], name=e["function"]["name"])
                call["arguments"] += e.get("function", {}).get("arguments", "")
        assert streamed_content == (content or "")
        assert [(assembled[i]["name"], assembled[i]["arguments"])
                for i in sorted(assembled)] == calls
        assert stream.tool_calls_started == bool(calls)


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_malformed_calls_are_content(parser, text):
    parsed = get_tool_parser(parser).parse(text)
    assert parsed.content == text and parsed.tool_calls == []


# Outputs cut by max_tokens mid-call: (parser, text, content, calls) with parse(text, cut=True);
# the stream announced the same calls, arguments as far as they went.
CUT = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     "Checking.", [("get_weather", '{"city": "Par')]),
    ("hermes", f'<tool_call>\n{{"name": "add", "arguments": {{"a": 1}}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "get_weather"', None,
     [("add", '{"a": 1}'), ("get_weather", "")]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b"', None, [("add", '{"a": 1, "b"')]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": ', None, [("add", '{"a": ')]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a"', None, [("add", '{"a"')]),
]


@pytest.mark.parametrize("parser,text,content,calls", CUT)
def test_a_call_cut_by_max_tokens_is_returned_as_far_as_it_went(parser, text, content, calls):
    p = get_tool_parser(parser)
    parsed = p.parse(text, cut=True)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert p.parse(text).tool_calls == []  # not cut: an unfinished call is the model's fault
    stream = p.stream()
    deltas = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [stream.finish()]
    streamed: dict[int, list[str]] = {}
    for e in (e for d in deltas for e in d.tool_calls):
        entry = streamed.setdefault(e["index"], ["", ""])
        entry[0] += e.get("function", {}).get("name", "")
        entry[1] += e.get("function", {}).get("arguments", "")
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
    # cut before the name is complete: nothing to call, the text stays content
    assert get_tool_parser("hermes").parse('<tool_call>\n{"na', cut=True).content == \
        '<tool_call>\n{"na'


def test_streamed_content_is_held_back_only_while_it_may_start_a_call():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hi <").content == "Hi"  # " <" may start "<tool_call>"
    assert stream.feed("b").content == " <b"
    assert stream.feed("\n").content == ""
    d = stream.feed("<tool_call>\n{\"name\": \"add\", ")
    assert d.content == "" and d.tool_calls[0]["function"] == {"name": "add", "arguments": ""}
    d = stream.feed('"arguments": {"a"')
    assert d.tool_calls == [{"index": 0, "function": {"arguments": '{"a"'}}]
    assert stream.feed(": 1}}").tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]


def test_unknown_parser_is_a_config_error():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "phi4_mini_json"}
    with pytest.raises(ConfigError, match="hermes"):
        get_tool_parser("nope")


# ---------------------------------------------------------------- tools and tool_choice


@pytest.mark.parametrize("tools,match", [
    ({"type": "function"}, "must be a list"),
    ([{"type": "code_interpreter"}], "only"),
    ([{"type": "function", "function": {"name": "bad name"}}], "letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], "unknown field"),
    ([ADD, ADD], "twice"),
])
def test_bad_tools_name_the_field(tools, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        parse_tools(tools)
    assert err.value.param == "tools"


def test_tool_choice():
    tools = parse_tools([WEATHER, ADD])
    assert parse_tool_choice(None, tools).mode == "auto"
    assert parse_tool_choice(None, ()).mode == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, tools).name == "add"
    for bad in ({"type": "function", "function": {"name": "sub"}}, "always", 3):
        with pytest.raises(InvalidRequest) as err:
            parse_tool_choice(bad, tools)
        assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequest, match="no tools"):
        parse_tool_choice("required", ())


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    """SmolLM2's tokenizer with another chat template (as --chat-template builds it)."""
    return Tokenizer(tok._backend, source=tok.source, bos_token=tok.bos_token,
                     eos_token=tok.eos_token, chat_template=template)


@pytest.fixture(scope="module")
def smollm2_grammars(smollm2_tok):
    from jaxserve.structured.grammar import GrammarCompiler

    tok = smollm2_tok
    return tok, GrammarCompiler(tok, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids)


def grammar_accepts(tok_and_grammars, constraint, text: str) -> bool:
    """Whether `text`, tokenized, is a complete match of `constraint` compiled for `tok`."""
    tok, grammars = tok_and_grammars
    matcher = grammars.compile(constraint).matcher(constraint.param)
    try:
        for t in tok.encode(text, add_special_tokens=False):
            matcher.accept(t)
    except GrammarViolation:
        return False
    return matcher.is_accepting


# Formats whose call is one JSON object with the function's name inside, and those that name
# the function in their markers (their grammars need the markers' special tokens).
FORCING = ["hermes", "llama3_json", "mistral", "phi4_mini_json"]
MARKED = {"openai": ["<|start|>", "<|end|>", "<|channel|>", "<|constrain|>", "<|message|>",
                     "<|call|>"],
          "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                          "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]}


def test_every_format_writes_forced_calls():
    assert set(TOOL_PARSERS) == set(FORCING) | set(MARKED)


@pytest.mark.parametrize("parser", FORCING)
def test_forced_call_grammar_accepts_exactly_valid_calls(parser, smollm2_grammars):
    """The forced-call constraint, compiled for SmolLM2's tokenizer: a valid call in the parser's
    own format is accepted to the end (and parses back), a wrong function or bad arguments are
    refused."""
    tok, grammars = smollm2_grammars
    tools = parse_tools([WEATHER, ADD])
    p = get_tool_parser(parser)
    assert forced_tool_call(tools, parse_tool_choice("auto", tools), p) is None
    named = forced_tool_call(tools, parse_tool_choice(
        {"type": "function", "function": {"name": "add"}}, tools), p)
    required = forced_tool_call(tools, parse_tool_choice("required", tools), p)
    assert named.param == required.param == "tools"
    one = {"hermes": '<tool_call>\n{{"name": "{n}", "{k}": {a}}}\n</tool_call>',
           "llama3_json": '{{"name": "{n}", "{k}": {a}}}',
           "mistral": '[TOOL_CALLS][{{"name": "{n}", "{k}": {a}}}]',
           "phi4_mini_json": 'functools[{{"name": "{n}", "{k}": {a}}}]'}[parser]
    key = p.arguments_key
    add = one.format(n="add", k=key, a='{"a": 1, "b": 2}')
    weather = one.format(n="get_weather", k=key, a='{"city": "Paris"}')
    bad_args = one.format(n="get_weather", k=key, a='{"town": "Paris"}')

    def accepts(constraint, text):
        return grammar_accepts(smollm2_grammars, constraint, text)

    assert accepts(named, add) and not accepts(named, weather)
    assert accepts(required, add) and accepts(required, weather)
    assert not accepts(required, bad_args)
    assert [c.name for c in p.parse(weather).tool_calls] == ["get_weather"]
    bad = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "uniqueItems": True}}}])
    with pytest.raises(InvalidRequest, match="uniqueItems") as err:
        grammars.compile(forced_tool_call(bad, parse_tool_choice("required", bad), p))
    assert err.value.param == "tools"


def with_special_tokens(tok: Tokenizer, tokens: list[str]) -> Tokenizer:
    """SmolLM2's tokenizer with a format's markers added as special tokens (as its model's
    vocabulary has them)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_str(tok.to_json())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    return Tokenizer(backend, source=tok.source, bos_token=tok.bos_token,
                     eos_token=tok.eos_token, chat_template=tok.chat_template)


@pytest.mark.parametrize("parser", sorted(MARKED))
def test_forced_calls_in_formats_that_name_the_function_in_markers(parser, smollm2_tok):
    """Harmony (`openai`) and DeepSeek (`deepseek_v3`): the call's markers are the vocabulary's
    special tokens, the name between them, the arguments held to the function's schema."""
    from jaxserve.structured.grammar import GrammarCompiler

    tok = with_special_tokens(smollm2_tok, MARKED[parser])
    grammars = (tok, GrammarCompiler(tok, vocab_size=tok.vocab_size,
                                     eos_token_ids=tok.eos_token_ids))
    tools = parse_tools([WEATHER, ADD])
    p = get_tool_parser(parser)
    named = forced_tool_call(tools, parse_tool_choice(
        {"type": "function", "function": {"name": "add"}}, tools), p)
    required = forced_tool_call(tools, parse_tool_choice("required", tools), p)
    if parser == "openai":
        one = "<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{a}"
        calls = "{}"
    else:
        one = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>"
        calls = "<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>"
    add = calls.format(one.format(n="add", a='{"a": 1, "b": 2}'))
    weather = calls.format(one.format(n="get_weather", a='{"city": "Paris"}'))

    def accepts(constraint, text):
        return grammar_accepts(grammars, constraint, text)

    assert accepts(named, add) and not accepts(named, weather)
    assert accepts(required, add) and accepts(required, weather)
    assert not accepts(required, weather.replace("city", "town"))
    assert not accepts(required, weather.replace("get_weather", "get_time"))
    assert [(c.name, c.arguments) for c in p.parse(weather).tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    if parser == "deepseek_v3":  # parallel calls, one a line; a named function: one call
        both = calls.format(one.format(n="add", a='{"a": 1, "b": 2}') + "\n"
                            + one.format(n="get_weather", a='{"city": "Paris"}'))
        assert accepts(required, both) and not accepts(named, both)
        assert [c.name for c in p.parse(both).tool_calls] == ["add", "get_weather"]
        serial = forced_tool_call(tools, parse_tool_choice("required", tools), p,
                                  parallel_tool_calls=False)
        assert not accepts(serial, both)
    # The markers must be the special tokens: a vocabulary without them cannot be held to it.
    with pytest.raises(InvalidRequest) as err:
        GrammarCompiler(smollm2_tok, vocab_size=smollm2_tok.vocab_size,
                        eos_token_ids=smollm2_tok.eos_token_ids).compile(required)
    assert err.value.param == "tools"


# ---------------------------------------------------------------- tools in the chat prompt

NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}|{% endfor %}")

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "19C"},
]


def test_template_with_tools_gets_them_and_objects_as_arguments(smollm2_tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(NATIVE_TEMPLATE)
    tok = _with_template(smollm2_tok, read_chat_template(str(path)))
    assert tok.template_uses_tools
    text = tok.apply_chat_template(HISTORY, tokenize=False, tools=parse_tools([WEATHER, ADD]))
    assert text.startswith("TOOLS:get_weather;add;|system:Be brief.|")
    assert text.endswith('|assistant:CALL get_weather {"city": "Paris"}|tool:18C|tool:19C|')


def test_fallback_lists_tools_and_writes_calls_and_results_as_text(smollm2_tok):
    tok = smollm2_tok  # SmolLM2's ChatML template knows nothing of tools
    assert not tok.template_uses_tools
    text = tok.apply_chat_template(HISTORY, tokenize=False, tools=parse_tools([WEATHER]))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>" in system
    assert json.dumps(parse_tools([WEATHER])[0].to_openai()) in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n19C\n"
            "</tool_response><|im_end|>") in text
    # the calls the fallback writes are what the hermes parser reads
    block = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert [(c.name, c.arguments) for c in get_tool_parser("hermes").parse(block).tool_calls] \
        == [("get_weather", '{"city": "Paris"}')]
    with pytest.raises(InvalidRequest, match="arguments is not valid JSON"):
        tok.apply_chat_template([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}], tokenize=False)


def test_chat_template_override(smollm2_path, tmp_path):
    """--chat-template (a file or the text) replaces the model's template."""
    assert read_chat_template("{{ messages[0].content }}!") == "{{ messages[0].content }}!"
    with pytest.raises(TokenizerError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(TokenizerError, match="does not compile"):
        read_chat_template("{% for %}")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}!")
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(str(smollm2_path)), str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"

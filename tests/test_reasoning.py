"""Reasoning parsers on fixed texts (whole and streamed in pieces, which must agree), the choice
of parser from a chat template, the chat message / deltas with reasoning and tool calls, and a
JSON constraint that holds after the reasoning block."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.serving.tool_output import ParserChoice, ToolCallOutput
from jaxserve.errors import ConfigError
from jaxserve.reasoning.parsers import detect, get_reasoning_parser
from jaxserve.tool_calling.parsers import get_tool_parser
# test_tool_calling's fixtures (SmolLM2's tokenizer and its grammar compiler) and matcher helper:
# ruff: noqa: F811
from tests.test_tool_calling import grammar_accepts, smollm2_grammars, smollm2_tok  # noqa: F401

# (parser, prompt left the block open, generated text, reasoning, content)
CASES = [
    ("qwen3", False, "<think>\nThe user wants Paris.\n</think>\n\nParis.",
     "The user wants Paris.", "Paris."),
    ("qwen3", False, "Paris.", None, "Paris."),  # enable_thinking false: no block
    ("qwen3", False, "  <think>\n\n</think>\n\nHi", "", "Hi"),  # an empty block
    ("qwen3", False, "Use <think> tags.", None, "Use <think> tags."),  # only at the start
    ("qwen3", False, "<thinking>x</thinking>", None, "<thinking>x</thinking>"),
    ("qwen3", True, "Hmm, 2 + 2.\n</think>\n\n4", "Hmm, 2 + 2.", "4"),  # opened by the prompt
    ("qwen3", False, "<think>\nStill thinking when max_tokens", "Still thinking when max_tokens",
     ""),
    ("deepseek_r1", False, "Okay, so <b>.\n</think>\n\nAnswer: 4", "Okay, so <b>.", "Answer: 4"),
    ("deepseek_r1", False, "<think>\nA</think>B", "A", "B"),
    ("deepseek_r1", False, "never closed", "never closed", ""),
]


@pytest.mark.parametrize("name,opened,text,reasoning,content", CASES)
def test_split_and_stream_agree(name, opened, text, reasoning, content):
    parser = get_reasoning_parser(name)
    split = parser.split(text, in_reasoning=opened)
    assert (split.reasoning, split.content) == (reasoning, content)
    for step in (1, 2, 3, 5, len(text)):
        stream = parser.stream(in_reasoning=opened)
        deltas = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        deltas.append(stream.finish())
        assert "".join(d.reasoning for d in deltas) == (reasoning or "")
        assert "".join(d.content for d in deltas) == content
        assert stream.reasoning_started == (reasoning is not None)


def test_streamed_reasoning_holds_back_only_a_possible_marker():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == stream.feed("nk>\n")  # undecided, then only the newline
    d = stream.feed("Paris is the capital.\n</th")
    assert (d.reasoning, d.content) == ("Paris is the capital.", "")
    d = stream.feed("ink>\n\nParis")
    assert (d.reasoning, d.content) == ("", "Paris")


def test_prompt_decides_where_the_output_starts():
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.starts_in_reasoning("<|im_start|>assistant\n")
    assert get_reasoning_parser("deepseek_r1").starts_in_reasoning("")
    with pytest.raises(ConfigError, match="qwen3"):
        get_reasoning_parser("nope")


def test_auto_choice_from_the_chat_template():
    class Tok:
        def __init__(self, template):
            self.chat_template = template
            self.all_special_ids = ()

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    think = "{{ '<think>\\n' + r + '\\n</think>\\n\\n' }}<tool_call>"
    assert detect(think) == "qwen3" and detect("{{ messages }}") is None and detect(None) is None
    auto = ParserChoice().for_tokenizer(Tok(think))
    assert auto.reasoning.name == "qwen3" and auto.tool.name == "hermes"
    assert not auto.reasoning_needs_special_tokens
    plain = ParserChoice().for_tokenizer(Tok("{{ '<|python_tag|>' }}"))
    assert plain.reasoning is None and plain.tool.name == "llama3_json"
    assert ParserChoice("mistral", "none").for_tokenizer(Tok(think)).reasoning is None
    with pytest.raises(ConfigError):
        ParserChoice("auto", "nope")


THOUGHT_AND_CALL = ('<think>\nI should call get_weather.\n</think>\n\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.mark.parametrize("tools", [True, False])
def test_message_and_deltas_carry_reasoning_content(tools):
    parser = get_tool_parser("hermes") if tools else None
    output = ToolCallOutput(parser, get_reasoning_parser("qwen3"))
    message, finish = output.message(THOUGHT_AND_CALL, "stop")
    assert message["reasoning_content"] == "I should call get_weather."
    if tools:
        assert finish == "tool_calls" and message["content"] is None
        assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                        "arguments": '{"city": "Paris"}'}
    else:
        assert finish == "stop" and message["content"].startswith("<tool_call>")
    streamed = ToolCallOutput(parser, get_reasoning_parser("qwen3"))
    got = {"reasoning_content": "", "content": "", "arguments": ""}
    pieces = [THOUGHT_AND_CALL[i:i + 4] for i in range(0, len(THOUGHT_AND_CALL), 4)]
    for i, piece in enumerate(pieces):
        delta, last = streamed.delta(0, piece, "stop" if i == len(pieces) - 1 else None)
        got["reasoning_content"] += delta.get("reasoning_content", "")
        got["content"] += delta.get("content", "")
        got["arguments"] += "".join(c.get("function", {}).get("arguments", "")
                                    for c in delta.get("tool_calls", ()))
    assert last == finish
    assert got["reasoning_content"] == message["reasoning_content"]
    assert got["content"] == (message["content"] or "")
    assert got["arguments"] == "".join(c["function"]["arguments"]
                                       for c in message.get("tool_calls", ()))


def test_flags_reach_the_server_config():
    from jaxserve.entrypoints.cli import build_parser
    from jaxserve.entrypoints.launcher import server_config

    def config(*flags):
        return server_config(build_parser().parse_args(["serve", "--model", "m", *flags]))

    assert (config().tool_call_parser, config().reasoning_parser) == ("auto", "auto")
    chosen = config("--tool-call-parser", "phi4_mini_json", "--reasoning-parser", "none")
    assert (chosen.tool_call_parser, chosen.reasoning_parser) == ("phi4_mini_json", "none")
    with pytest.raises(SystemExit):
        config("--reasoning-parser", "nope")


def test_a_json_constraint_holds_after_the_reasoning_block(smollm2_grammars):
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.structured import StructuredOutputsParams as SO

    schema = SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"], "additionalProperties": False}, param="response_format")
    qwen3 = get_reasoning_parser("qwen3")

    class Tok:  # the rendered prompt's end, as decode gives it
        def __init__(self, tail):
            self.tail = tail

        def decode(self, ids, skip_special_tokens=True):
            return self.tail

    output = ToolCallOutput(None, qwen3)
    cases = {"<|im_start|>assistant\n<think>\n": True, "<|im_start|>assistant\n": False}
    for tail, opened in cases.items():
        out, params = output.after_prompt(Tok(tail), [1], SamplingParams(structured_outputs=schema))
        constraint = params.structured_outputs
        assert out.in_reasoning is opened and constraint.reasoning == qwen3.grammar(opened)
        assert constraint.param == "response_format"

        def accepts(text):
            return grammar_accepts(smollm2_grammars, constraint, text)

        # free text inside the block, even JSON-like; then the schema, after any whitespace
        assert accepts('<think>\nSay {"b": 2}?\n</think>\n\n{"a": 1}')
        assert accepts('Hmm.\n</think>\n\n{"a": 1}') is opened  # the prompt opened the block
        assert accepts('{"a": 1}') is not opened  # no block: only where the model opens it
        assert not accepts('<think>\nx\n</think>\n\n{"b": 1}') and not accepts("Paris")
    regex = SO(regex="[0-9]+")  # other kinds still hold from the first token
    assert regex.after_reasoning(qwen3.grammar(True)) is regex


def test_a_json_constraint_holds_in_harmony_s_final_message(smollm2_tok):
    """gpt-oss: the constraint lets the model open its analysis channel with the vocabulary's
    special tokens (not their text spelled out), then holds the final message to the schema."""
    from jaxserve.structured import StructuredOutputsParams as SO
    from jaxserve.structured.grammar import GrammarCompiler
    from tests.test_tool_calling import MARKED, with_special_tokens

    tok = with_special_tokens(smollm2_tok, MARKED["openai"] + ["<|return|>"])
    grammars = (tok, GrammarCompiler(tok, vocab_size=tok.vocab_size,
                                     eos_token_ids=tok.eos_token_ids))
    schema = SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"], "additionalProperties": False}, param="response_format")
    constraint = schema.after_reasoning(get_reasoning_parser("openai_gptoss").grammar(False))

    def accepts(text):
        return grammar_accepts(grammars, constraint, text)

    assert accepts('<|channel|>analysis<|message|>Say {"b": 2}?\nYes.<|end|>'
                   '<|start|>assistant<|channel|>final<|message|>{"a": 1}')
    assert accepts('<|channel|>final<|message|>{"a": 1}')  # no analysis
    assert not accepts('{"a": 1}')  # the body belongs in the final message
    assert not accepts('<|channel|>final<|message|>{"b": 1}')
    assert not accepts('<|channel|>analysis<|message|>x<|end|><|start|>assistant{"a": 1}')

"""The chat templates of the families jaxserve serves (tests/chat_templates/, as the models ship
them) rendered by jaxserve's sandbox: plain chats, system messages, tools (the template's own or
the fallback), earlier calls and results, `chat_template_kwargs`; and the tool-call and reasoning
parsers "auto" picks for each, on outputs in that family's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from jaxserve.entrypoints.serving.protocol import parse_chat_request
from jaxserve.entrypoints.serving.tool_output import ParserChoice, ToolCallOutput
from jaxserve.errors import InvalidRequest
from jaxserve.tokenizer import Tokenizer
from jaxserve.tool_calling.functions import parse_tools

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = parse_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}])
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def _tokenizer(name: str, bos: str = "<s>", eos: str = "</s>") -> Tokenizer:
    # Rendering to text needs no vocabulary: a one-token backend keeps the test fast.
    backend = Backend(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return Tokenizer(backend, source=name, bos_token=bos, eos_token=eos,
                     chat_template=(TEMPLATES / f"{name}.jinja").read_text())


def _history(call_id: str) -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "18C"}]


def _parsers(tok: Tokenizer):
    parsers = ParserChoice().for_tokenizer(tok)
    return parsers.tool.name, parsers.reasoning and parsers.reasoning.name


def test_qwen3_thinking_switch_tools_and_reasoning():
    tok = _tokenizer("qwen3", bos=None, eos="<|im_end|>")
    assert tok.template_uses_tools and _parsers(tok) == ("hermes", "qwen3")
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # enable_thinking reaches the template as the request sent it, as vLLM passes it
    kwargs = parse_chat_request({"model": "m", "messages": CHAT, "chat_template_kwargs": {
        "enable_thinking": False}}).chat_template_kwargs
    off = tok.apply_chat_template(CHAT, tokenize=False, template_kwargs=kwargs)
    assert off == text + "<think>\n\n</think>\n\n"
    reasoning = ParserChoice().for_tokenizer(tok).reasoning
    assert not reasoning.starts_in_reasoning(text) and not reasoning.starts_in_reasoning(off)
    # tools, the earlier call and its result, and an earlier answer's reasoning
    history = _history("call_1") + [{"role": "assistant", "content": "18C, sunny.",
                                     "reasoning_content": "The tool said 18C."}]
    text = tok.apply_chat_template(history, tokenize=False, tools=WEATHER)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER[0].to_openai()) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C'
            '\n</tool_response><|im_end|>\n') in text
    assert text.endswith("<|im_start|>assistant\n<think>\nThe tool said 18C.\n</think>\n\n"
                         "18C, sunny.<|im_end|>\n<|im_start|>assistant\n")
    output = ToolCallOutput(ParserChoice().for_tokenizer(tok).tool, reasoning)
    message, finish = output.message(
        '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>', "stop")
    assert finish == "tool_calls" and message["reasoning_content"] == "I need the weather."
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_gemma2_refuses_system_messages_and_takes_tools_in_the_first_user_turn():
    tok = _tokenizer("gemma2", bos="<bos>", eos="<eos>")
    assert not tok.template_uses_tools and _parsers(tok) == ("hermes", None)
    with pytest.raises(InvalidRequest, match="System role not supported") as err:
        tok.apply_chat_template(CHAT, tokenize=False)
    assert err.value.param == "messages"
    text = tok.apply_chat_template(CHAT[1:] + [{"role": "assistant", "content": " Hello. "},
                                               {"role": "user", "content": "Bye"}],
                                   tokenize=False)
    assert text == ("<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nHello."
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n"
                    "<start_of_turn>model\n")
    # The fallback's tools go to the first user turn, as the template takes no system message.
    text = tok.apply_chat_template(_history("call_1"), tokenize=False, tools=WEATHER)
    assert text.startswith("<bos><start_of_turn>user\n# Tools\n")
    assert "</tool_call>\n\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n<tool_call>" \
        in text
    assert "<start_of_turn>user\n<tool_response>\n18C\n</tool_response><end_of_turn>" in text


def test_gemma3_folds_the_system_message_and_the_fallback_tools_into_the_first_turn():
    tok = _tokenizer("gemma3", bos="<bos>", eos="<eos>")
    assert not tok.template_uses_tools and _parsers(tok) == ("hermes", None)
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n")
    text = tok.apply_chat_template(CHAT, tokenize=False, tools=WEATHER)
    first_turn = text.split("<end_of_turn>")[0]
    assert first_turn.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools")
    assert "<tools>" in first_turn and first_turn.endswith("</tool_call>\n\nhi")


@pytest.mark.parametrize("name, expected", [
    ("phi3", "<|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"),
    ("phi4_mini", "<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>"),
])
def test_phi_turns(name, expected):
    tok = _tokenizer(name, eos="<|endoftext|>")
    assert tok.apply_chat_template(CHAT, tokenize=False) == expected
    assert _parsers(tok) == ("hermes", None)  # no tools in the template: the fallback's format


def test_llama3_1_tools_in_the_first_user_message_and_json_calls():
    tok = _tokenizer("llama3_1", bos="<|begin_of_text|>", eos="<|eot_id|>")
    assert tok.template_uses_tools and _parsers(tok) == ("llama3_json", None)
    text = tok.apply_chat_template(CHAT, tokenize=False,
                                   template_kwargs={"date_string": "27 Nov 2026"})
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting "
                    "Knowledge Date: December 2023\nToday Date: 27 Nov 2026\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    text = tok.apply_chat_template(_history("call_1"), tokenize=False, tools=WEATHER)
    assert "Environment: ipython\n" in text and '"name": "get_weather"' in text
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|eot_id|>') in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18C"<|eot_id|>' in text
    parser = ParserChoice().for_tokenizer(tok).tool
    calls = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}').tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_mistral_tools_and_nine_character_call_ids():
    tok = _tokenizer("mistral_v03")
    assert tok.template_uses_tools and _parsers(tok) == ("mistral", None)
    parser = ParserChoice().for_tokenizer(tok).tool
    (call,) = parser.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": '
                           '{"city": "Paris"}}]').tool_calls
    # the ids this parser gives are ones the template takes back in the next turn
    text = tok.apply_chat_template(_history(call.id), tokenize=False, tools=WEATHER)
    assert text == (
        '<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
        '"description": "Current weather", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}, "required": ["city"]}}}][/AVAILABLE_TOOLS][INST] Weather '
        'in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        f'"id": "{call.id}"}}]</s>[TOOL_RESULTS] {{"content": 18C, "call_id": "{call.id}"}}'
        '[/TOOL_RESULTS]')
    with pytest.raises(InvalidRequest, match="length 9"):  # the template's own rule
        tok.apply_chat_template(_history("call_0123456789"), tokenize=False, tools=WEATHER)


@pytest.mark.parametrize("kwargs, match", [
    ({"messages": []}, "set by the server"),
    ({"add_generation_prompt": False}, "set by the server"),
    ({"not a name": 1}, "not a template variable name"),
    ({f"k{i}": i for i in range(33)}, "at most 32"),
    ({"big": "x" * 20_000}, "longer than"),
])
def test_chat_template_kwargs_are_bounded(kwargs, match):
    with pytest.raises(InvalidRequest, match=match) as err:
        parse_chat_request({"model": "m", "messages": CHAT, "chat_template_kwargs": kwargs})
    assert err.value.param == "chat_template_kwargs"


DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]


def deepseek_checkpoint_tokenizer(path: Path, vocab: Backend) -> Path:
    """A checkpoint directory's tokenizer as DeepSeek-V3 ships it: its special tokens in
    tokenizer.json, tokenizer_config.json with AddedToken dicts and the chat template."""
    from tokenizers import AddedToken

    path.mkdir(parents=True, exist_ok=True)
    vocab.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t in DEEPSEEK_SPECIAL])
    vocab.save(str(path / "tokenizer.json"))

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False,
                "normalized": True, "rstrip": False, "single_word": False}

    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, "bos_token": added(DEEPSEEK_SPECIAL[0]),
        "clean_up_tokenization_spaces": False, "eos_token": added(DEEPSEEK_SPECIAL[1]),
        "legacy": True, "model_max_length": 131072, "pad_token": added(DEEPSEEK_SPECIAL[1]),
        "sp_model_kwargs": {}, "unk_token": None, "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": (TEMPLATES / "deepseek_v3.jinja").read_text()}, ensure_ascii=False))
    return path


def test_deepseek_v3_template_from_the_checkpoint_directory_renders_and_parses_calls(tmp_path):
    """DeepSeek-V3's template (from its tokenizer_config.json) renders the history's calls and
    results itself but lists no tools: the tools prompt teaches its call format, the calls go to
    it as OpenAI sends them (content null or ""), and `auto` parses its output."""
    from jaxserve.model_registry import ModelSpec
    from jaxserve.tokenizer import load_tokenizer

    path = deepseek_checkpoint_tokenizer(tmp_path / "ds", Backend(models.WordLevel(
        {"[UNK]": 0, "Weather": 1}, unk_token="[UNK]")))
    tok = load_tokenizer(ModelSpec("ds", "hf", path))
    assert tok.chat_template == (TEMPLATES / "deepseek_v3.jinja").read_text()
    assert (tok.bos_token, tok.template_uses_tools) == ("<｜begin▁of▁sentence｜>", False)
    assert _parsers(tok) == ("deepseek_v3", None)
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜>")
    for content in (None, ""):
        history = _history("call_1")
        history[1]["content"] = content
        text = tok.apply_chat_template(history, tokenize=False, tools=WEATHER)
        tools, turns = text.split("<｜User｜>", 1)
        assert tools.startswith("<｜begin▁of▁sentence｜># Tools\n") and '"get_weather"' in tools
        assert tools.endswith("<｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
                              "<arguments-object>\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>"
                              "function<｜tool▁sep｜><another-function-name>\n```json\n"
                              "<arguments-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        # (DeepSeek's template closes the calls only after a second one: as shipped.)
        assert turns == ("Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                         "function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
                         "<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18C"
                         "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    ids = tok.apply_chat_template(_history("c"), tools=WEATHER)
    for marker in ("<｜tool▁calls▁begin｜>", "<｜tool▁output▁begin｜>"):
        assert tok.encode(marker, add_special_tokens=False)[0] in ids  # one special token each
    parsers = ParserChoice().for_tokenizer(tok)
    output = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
              '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    message, finish = ToolCallOutput(parsers.tool, parsers.reasoning).message(output, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [("get_weather", '{"city": "Oslo"}')]

"""Chat formats through a real server on a tiny random model whose GGUF carries a thinking
template (Qwen3-Thinking style: the generation prompt opens `<think>`, `enable_thinking: false`
closes it): the output is returned as `reasoning_content` (whole, streamed, and as a Responses
reasoning item) unless `chat_template_kwargs` turns thinking off, and a JSON response format
holds only after the block; a forced tool call cut by max_tokens comes back with finish_reason
"length" and its arguments so far. Forced calls in the marker formats (gpt-oss's Harmony,
DeepSeek's), and llama.cpp's gpt-oss and deepseek2 GGUF mixtures of experts served with the
file's template and the parsers it implies."""

from __future__ import annotations

import json

import openai
import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from tests.test_cli import tiny_gguf
from tests.test_server import ServerThread

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path_factory.mktemp("thinking") / "tiny.gguf",
                     {**smollm2_tokenizer_fields, "tokenizer.chat_template": THINKING},
                     max_position_embeddings=512)
    engine = AsyncEngine(build_engine(str(path), num_pages=24, max_num_seqs=2,
                                      max_num_batched_tokens=32, max_model_len=384,
                                      min_token_bucket=16, strict_compile=True, progress=False))
    srv = ServerThread("tiny")  # --tool-call-parser / --reasoning-parser auto
    try:
        srv.attach(engine)
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    finally:
        srv.stop()
        engine.shutdown()


def test_reasoning_content_whole_streamed_and_switched_off(client):
    whole = client.chat.completions.create(model="tiny", messages=ASK, **GREEDY)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content is None  # cut inside the block the prompt opened
    assert whole.choices[0].finish_reason == "length"
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, stream=True,
                                                **GREEDY):
        for choice in chunk.choices:
            for key in streamed:
                streamed[key] += (choice.delta.model_extra.get(key) if key != "content"
                                  else choice.delta.content) or ""
    assert streamed == {"reasoning_content": reasoning, "content": ""}
    off = client.chat.completions.create(
        model="tiny", messages=ASK,
        **{**GREEDY, "extra_body": {"ignore_eos": True,
                                    "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.choices[0].message.content
    assert "reasoning_content" not in off.choices[0].message.model_extra
    assert off.usage.prompt_tokens > whole.usage.prompt_tokens  # the closed block is prompt
    # A JSON response format holds after the block: the model thinks freely first.
    constrained = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=8,
        response_format={"type": "json_object"})
    assert constrained.choices[0].message.model_extra["reasoning_content"]
    assert constrained.choices[0].message.content is None
    r = client.responses.create(model="tiny", input="What is 2 + 2?", temperature=0,
                                max_output_tokens=8)
    assert [item.type for item in r.output] == ["reasoning"]
    assert r.output[0].content[0].text and r.status == "incomplete"


def test_forced_call_cut_by_max_tokens_is_returned_with_length(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "minLength": 200}},
        "required": ["city"]}}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[tool], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith('{"city": "')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut: the arguments as far as they went


# Forced calls in the formats that name the function in their markers, through the chat route of
# a real server on a tiny random model: SmolLM2's vocabulary plus the family's special tokens,
# the family's template as it ships (tests/chat_templates/).
MARKED = {
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                    "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"],
    "gpt_oss": ["<|startoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>",
                "<|channel|>", "<|constrain|>", "<|call|>"],
}
# Bounded arguments: a random model fills whatever the schema leaves open. (gpt-oss's template
# needs a description.)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Sum", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
    "required": ["a", "b"], "additionalProperties": False}}}


def _marked_gguf(path, fields: dict, family: str):
    from pathlib import Path

    from tests.test_weights import random_params, tiny, write_gguf

    tokens = list(fields["tokenizer.ggml.tokens"]) + MARKED[family]
    config = tiny(vocab_size=len(tokens), max_position_embeddings=1024,
                  eos_token_ids=(len(tokens) - len(MARKED[family]) + 1,))  # the 2nd marker

    def add_tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_merges(fields["tokenizer.ggml.merges"])
        w.add_token_types(list(fields["tokenizer.ggml.token_type"]) + [3] * len(MARKED[family]))
        w.add_chat_template((Path(__file__).parent / "chat_templates" / f"{family}.jinja")
                            .read_text())

    return write_gguf(path, config, random_params(config), add_metadata=add_tokenizer)


@pytest.mark.parametrize("family, parser", [("deepseek_v3", "deepseek_v3"),
                                            ("gpt_oss", "openai")])
def test_forced_calls_in_marker_formats_through_the_chat_route(
        tmp_path, smollm2_tokenizer_fields, family, parser):
    from jaxserve.tool_calling.parsers import detect

    path = _marked_gguf(tmp_path / f"{family}.gguf", smollm2_tokenizer_fields, family)
    engine = AsyncEngine(build_engine(str(path), num_pages=48, max_num_seqs=1,
                                      max_num_batched_tokens=64, max_model_len=640,
                                      min_token_bucket=64, warmup=False, progress=False))
    assert detect(engine.tokenizer.chat_template) == parser
    srv = ServerThread("tiny")  # --tool-call-parser auto
    try:
        srv.attach(engine)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "Weather in Paris, or 2 + 3?"}]
        r = client.chat.completions.create(model="tiny", messages=ask, tools=[WEATHER, ADD],
                                           tool_choice="required", temperature=0,
                                           max_tokens=200, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls  # (a random model repeats calls if let)
        assert call.function.name in ("get_weather", "add")
        assert set(json.loads(call.function.arguments)) == (
            {"city"} if call.function.name == "get_weather" else {"a", "b"})
        named = client.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER, ADD], temperature=0, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "add"}}, stream=True)
        name, arguments, finish = "", "", None
        for chunk in named:
            for choice in chunk.choices:
                for d in choice.delta.tool_calls or ():
                    assert d.index == 0
                    name += (d.function and d.function.name) or ""
                    arguments += (d.function and d.function.arguments) or ""
                finish = choice.finish_reason or finish
        assert (name, finish) == ("add", "tool_calls")
        assert set(json.loads(arguments)) == {"a", "b"}
    finally:
        srv.stop()
        engine.shutdown()


# llama.cpp's gpt-oss and deepseek2 files (mixtures of experts; tests/test_gguf_moe.py checks
# their outputs against HF's) served as a user would, parsers on auto. Their committed
# vocabularies spell no text (markers and placeholder names), so the same ids get byte-level
# names here: each file's control tokens (its family's markers) kept, the next 96 ids printable
# ASCII, space and newline, the rest unused; context 1024 so the family's template fits. The
# weights and ids are the file's (HF's logits within 1e-4 still, measured).
CRAFTED = {  # a completion each family's parsers must split (the random weights write none)
    "gpt-oss": ("<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}<|call|>', "Needs the weather.", None),
    "deepseek2": ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                  'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                  "<｜tool▁calls▁end｜>", None, "Let me check."),
}


def _spelled(arch: str, path):
    from gguf import GGUFReader

    from tests.test_gguf_moe import FIXTURES, _rewrite

    src = FIXTURES / arch / "model.gguf"
    fields = GGUFReader(str(src)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    control = sum(t == 3 for t in fields["tokenizer.ggml.token_type"].contents())
    names = tokens[:control] + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    names += [f"t{i}" for i in range(len(names), len(tokens))]
    _rewrite(src, path, {"tokenizer.ggml.tokens": names, "{arch}.context_length": 1024})
    return path


@pytest.mark.parametrize("arch, parsers", [("gpt-oss", ("openai", "openai_gptoss")),
                                           ("deepseek2", ("deepseek_v3", None))])
def test_gguf_mixture_chats_with_the_files_template_and_parsers(tmp_path, arch, parsers):
    from jaxserve.entrypoints.http.app_state import STATE_KEY
    from jaxserve.entrypoints.serving.tool_output import ToolCallOutput

    path = _spelled(arch, tmp_path / f"{arch}.gguf")
    engine = AsyncEngine(build_engine(str(path), num_pages=72, max_num_seqs=1,
                                      max_num_batched_tokens=64, max_model_len=1024,
                                      min_token_bucket=64, warmup=False, progress=False))
    tok = engine.tokenizer
    srv = ServerThread("moe")  # --tool-call-parser / --reasoning-parser auto
    try:
        srv.attach(engine)
        chosen = srv.app[STATE_KEY].serving.parsers.for_tokenizer(tok)
        assert (chosen.tool.name, chosen.reasoning and chosen.reasoning.name) == parsers
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "Weather in Paris, or 2 + 3?"}]
        r = client.chat.completions.create(model="moe", messages=ask, **GREEDY)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        # The file's template rendered the prompt (gpt-oss's opens with its system message).
        assert r.usage.prompt_tokens == len(tok.apply_chat_template(ask))
        assert tok.apply_chat_template(ask, tokenize=False).startswith(
            "<|start|>system<|message|>You are ChatGPT" if arch == "gpt-oss"
            else "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris")
        r = client.chat.completions.create(model="moe", messages=ask, tools=[WEATHER, ADD],
                                           tool_choice="required", temperature=0,
                                           max_tokens=120, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == (
            {"city"} if call.function.name == "get_weather" else {"a", "b"})
    finally:
        srv.stop()
        engine.shutdown()
    # A completion in the family's format, through the vocabulary (markers one token each) and
    # the parsers the server chose, as a chat with tools parses it.
    text, reasoning, content = CRAFTED[arch]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    message, finish = ToolCallOutput(chosen.tool, chosen.reasoning).message(text, "stop")
    assert (message.get("reasoning_content"), message["content"], finish) == (
        reasoning, content, "tool_calls")
    (call,) = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather", {"city": "Paris"})

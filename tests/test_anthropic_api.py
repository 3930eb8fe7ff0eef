"""Anthropic's Messages API through a real server, with the official `anthropic` client: a tiny
random model whose template thinks (Qwen3-Thinking style), answered whole and streamed (the same
greedy content), thinking on and off, a forced tool call and its tool_result turn, stop sequences,
cached-prompt usage (on the OpenAI routes too) and its price, count_tokens, and Anthropic's error
bodies (x-api-key authenticates)."""

from __future__ import annotations

import logging

import anthropic
import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.http.app import attach_engine
from jaxserve.gateway.pricing import Pricing
from tests.test_chat_formats_server import THINKING
from tests.test_cli import tiny_gguf
from tests.test_server import ServerThread, _request, access_records, http_get, wait_for
from tests.test_tenancy_server import metric_values

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]
"""
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
# The current client has no sampling arguments; older ones and other clients send them.
GREEDY = {"model": "tiny", "max_tokens": 8, "extra_body": {"temperature": 0.0}}
# USD per million tokens; a cached prompt token costs a quarter of another one
PRICES = Pricing(prompt_per_1m=2.0, completion_per_1m=8.0, cached_prompt_per_1m=0.5)
TOOL = {"name": "add", "description": "Add two numbers",
        # small values: a random model's free integers could run to max_tokens
        "input_schema": {"type": "object", "properties": {"a": {"enum": [1, 2, 3]},
                                                          "b": {"enum": [1, 2, 3]}},
                         "required": ["a", "b"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("anthropic")
    (d / "tenants.toml").write_text(TENANTS)
    path = tiny_gguf(d / "tiny.gguf",
                     {**smollm2_tokenizer_fields, "tokenizer.chat_template": THINKING},
                     max_position_embeddings=512)
    engine = AsyncEngine(build_engine(str(path), num_pages=32, max_num_seqs=2,
                                      max_num_batched_tokens=32, max_model_len=384,
                                      min_token_bucket=16, strict_compile=True, progress=False))
    srv = ServerThread("tiny", tenants_file=str(d / "tenants.toml"))
    try:
        srv.loop.call_soon_threadsafe(attach_engine, srv.app, engine, None, PRICES)
        wait_for(lambda: http_get(f"{srv.url}/ready").status_code == 200, "ready")
        yield srv
    finally:
        srv.stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sk-alice", max_retries=0)


def test_whole_and_streamed_agree_with_thinking_on_and_off(client):
    # (enabled needs a budget of 1024+ tokens, past this model's context: adaptive thinks too)
    on = client.messages.create(messages=ASK, thinking={"type": "adaptive"}, **GREEDY)
    assert on.type == "message" and on.role == "assistant" and on.model == "tiny"
    assert on.content[0].type == "thinking" and on.content[0].thinking
    with client.messages.stream(messages=ASK, thinking={"type": "adaptive"}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in on.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (on.stop_reason,
                                                                    on.usage.output_tokens)
    off = client.messages.create(messages=ASK, thinking={"type": "disabled"}, **GREEDY)
    assert [b.type for b in off.content] == ["text"] and off.stop_reason == "max_tokens"
    assert off.usage.output_tokens == 8
    # The template's closed thinking block is part of the prompt: more input tokens.
    assert (off.usage.input_tokens + off.usage.cache_read_input_tokens
            > on.usage.input_tokens + on.usage.cache_read_input_tokens)


def test_stop_sequence_and_prompt_cache_usage(client):
    system = "You answer questions. " * 8  # a few pages of shared prefix
    first = client.messages.create(messages=ASK, system=system, thinking={"type": "disabled"},
                                   **GREEDY)
    text = first.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.messages.create(messages=ASK, system=system, thinking={"type": "disabled"},
                                 stop_sequences=[stop], **GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text
    # The second request read the shared prefix from the cache, and says so.
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert cut.usage.cache_read_input_tokens > 0
    assert cut.usage.input_tokens + cut.usage.cache_read_input_tokens == total
    counted = client.messages.count_tokens(model="tiny", messages=ASK, system=system,
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == total


def test_forced_tool_call_then_its_result(client):
    called = client.messages.create(messages=[{"role": "user", "content": "Add 2 and 3"}],
                                    tools=[TOOL], tool_choice={"type": "tool", "name": "add"},
                                    **{**GREEDY, "max_tokens": 64})
    use = [b for b in called.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "add", called
    assert called.stop_reason == "tool_use" and set(use[0].input) == {"a", "b"}
    with client.messages.stream(messages=[{"role": "user", "content": "Add 2 and 3"}],
                                tools=[TOOL], tool_choice={"type": "tool", "name": "add"},
                                **{**GREEDY, "max_tokens": 64}) as stream:
        streamed = stream.get_final_message()
    assert [b for b in streamed.content if b.type == "tool_use"][0].input == use[0].input
    follow = client.messages.create(
        messages=[{"role": "user", "content": "Add 2 and 3"},
                  {"role": "assistant", "content": [b.model_dump() for b in called.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                "content": "5"}]}],
        tools=[TOOL], thinking={"type": "disabled"}, **GREEDY)
    assert follow.content and follow.usage.input_tokens + follow.usage.cache_read_input_tokens \
        > called.usage.input_tokens + called.usage.cache_read_input_tokens


@pytest.mark.parametrize("body, param_word", [
    ({"model": "tiny", "messages": ASK}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "type"),
    ({"model": "tiny", "max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 10}},
     "budget_tokens"),
    ({"model": "tiny", "max_tokens": 8, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [TOOL]}, "nope"),
    ({"model": "tiny", "max_tokens": 8, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"model": "tiny", "max_tokens": 8, "messages": ASK, "system": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5},
     "cache_control"),
])
def test_bad_requests_are_anthropic_400s_naming_the_field(server, body, param_word):
    resp = _request("POST", f"{server.url}/v1/messages", body,
                    headers={"x-api-key": "sk-alice", "anthropic-version": "2023-06-01"})
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param_word in error["error"]["message"]


def test_wrong_key_and_unknown_model(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(messages=ASK, **GREEDY)
    assert e.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=server.url, api_key="sk-alice", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        good.messages.create(messages=ASK, **{**GREEDY, "model": "nope"})
    assert e.value.body["error"]["type"] == "not_found_error"


def test_openai_routes_report_cached_prompt_tokens_too(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice", max_retries=0)
    messages = [{"role": "system", "content": "You answer questions. " * 8}, *ASK]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def _priced(prompt: int, completion: int, cached: int) -> float:
    return ((prompt - cached) * 2.0 + cached * 0.5 + completion * 8.0) / 1e6


def test_cached_prompt_tokens_are_priced_at_their_own_rate(server, client, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    system = "You price tokens and nothing else. " * 6
    body = {"model": "tiny", "messages": [{"role": "system", "content": system}, *ASK],
            "max_tokens": 2, "temperature": 0}
    auth = {"Authorization": "Bearer sk-alice"}
    first, again = (_request("POST", f"{server.url}/v1/chat/completions", body,
                             headers=auth).json()["usage"] for _ in range(2))
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 and cached > 0
    assert first["cost"] == pytest.approx(_priced(first["prompt_tokens"],
                                                  first["completion_tokens"], 0))
    assert again["cost"] == pytest.approx(_priced(again["prompt_tokens"],
                                                  again["completion_tokens"], cached))
    assert again["cost"] < first["cost"]
    # Anthropic's usage of the same kind of request: what it reads from the cache is what is
    # priced at the cached rate (the tenant's cost counter), and what the access log records.
    records = wait_for(lambda: access_records(caplog, 2), "the access-log lines")
    spent = metric_values(server.url)[("jaxserve:cost_usd_total", (("tenant", "alice"),))]
    msg = client.messages.create(messages=ASK, system=system, thinking={"type": "disabled"},
                                 **GREEDY)
    u = msg.usage
    assert u.cache_read_input_tokens > 0 and u.cache_creation_input_tokens == 0
    prompt = u.input_tokens + u.cache_read_input_tokens
    records = wait_for(lambda: access_records(caplog, 3), "the access-log lines")
    assert (records[-1]["prompt_tokens"], records[-1]["cached_tokens"]) == (
        prompt, u.cache_read_input_tokens)
    assert records[1]["cached_tokens"] == cached
    after = wait_for(lambda: (lambda v: v if v > spent else None)(metric_values(server.url)[
        ("jaxserve:cost_usd_total", (("tenant", "alice"),))]), "the cost counter")
    assert after - spent == pytest.approx(_priced(prompt, u.output_tokens,
                                                  u.cache_read_input_tokens))


def _flood(client, n: int) -> None:
    """Prompts of other text (about 300 tokens each) whose pages push the unpinned ones out of the
    32-page pool."""
    for i in range(n):
        client.messages.create(
            messages=[{"role": "user", "content": " ".join(f"flood{i} item{j}."
                                                           for j in range(60))}],
            thinking={"type": "disabled"}, **{**GREEDY, "max_tokens": 1})


def test_openai_prompt_cache_breakpoint_pins_through_a_flood(server, client):
    """OpenAI's shape (the openai client): a text part's prompt_cache_breakpoint pins the prompt
    through it, as cache_control does; the same system prompt unpinned is evicted by the flood."""
    import openai

    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice", max_retries=0)

    def ask(system, **kw):
        return oai.chat.completions.create(model="tiny", max_tokens=1, temperature=0, messages=[
            {"role": "system", "content": system}, *ASK], **kw).usage

    plain = "Unpinned rules: reply in one short word. " * 3
    ask(plain)
    _flood(client, 3)
    assert ask(plain).prompt_tokens_details.cached_tokens == 0  # evicted: no pin
    pins = metric_values(server.url)[("jaxserve:kv_cache_pins", ())]
    text = "Pinned rules: reply in one short word. " * 3
    pinned = [{"type": "text", "text": text, "prompt_cache_breakpoint": {"mode": "explicit"}}]
    made = ask(pinned, prompt_cache_key="rules", prompt_cache_options={"ttl": "30m"})
    assert metric_values(server.url)[("jaxserve:kv_cache_pins", ())] == pins + 1
    _flood(client, 3)
    read = ask(pinned)
    assert read.prompt_tokens == made.prompt_tokens
    # the whole pages of the system prompt (about 40 tokens) survived the flood
    assert read.prompt_tokens_details.cached_tokens >= 32
    with pytest.raises(openai.BadRequestError) as e:
        ask([{**pinned[0], "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}])
    assert "prompt_cache_breakpoint.ttl" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        ask(pinned * 5)
    assert e.value.param == "prompt_cache_breakpoint"
    # The Responses API: the same pin through an input_text part (stored nowhere: store false).
    text = "Pinned by a response: reply in one word. " * 3
    mark = [{"role": "system", "content": [{"type": "input_text", "text": text,
                                            "prompt_cache_breakpoint": {"mode": "explicit"}}]},
            {"role": "user", "content": "What is 2 + 2?"}]
    pins = metric_values(server.url)[("jaxserve:kv_cache_pins", ())]
    oai.responses.create(model="tiny", input=mark, max_output_tokens=1, store=False,
                         temperature=0, prompt_cache_options={"ttl": "5m"})
    assert metric_values(server.url)[("jaxserve:kv_cache_pins", ())] == pins + 1
    _flood(client, 3)
    usage = oai.responses.create(model="tiny", input=mark, max_output_tokens=1, store=False,
                                 temperature=0).usage
    assert usage.input_tokens_details.cached_tokens >= 32


def test_cache_control_pins_the_system_prompt_through_a_flood(client):
    """Last in the module: the pin it makes holds pool pages for 5 minutes."""
    ask = {"messages": ASK, "thinking": {"type": "disabled"}, **{**GREEDY, "max_tokens": 1}}
    plain = "Plain instructions: answer in one word, then stop. " * 4
    first = client.messages.create(system=plain, **ask)
    assert first.usage.cache_creation_input_tokens == 0
    _flood(client, 3)
    again = client.messages.create(system=plain, **ask)
    assert again.usage.cache_read_input_tokens == 0  # evicted: no pin

    pinned = [{"type": "text", "text": "Pinned instructions: answer briefly and kindly. " * 4,
               "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    made = client.messages.create(system=pinned, **ask)
    created = made.usage.cache_creation_input_tokens
    assert created > 0 and created % 16 == 0  # whole pages of the system prompt
    _flood(client, 3)
    read = client.messages.create(system=pinned, **ask)
    assert read.usage.cache_read_input_tokens >= created
    assert read.usage.cache_creation_input_tokens == 0  # the pin was renewed, not made again
    assert (read.usage.input_tokens + read.usage.cache_read_input_tokens
            == made.usage.input_tokens + created + made.usage.cache_read_input_tokens)

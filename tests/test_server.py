"""The OpenAI-compatible HTTP server end to end: the real engine behind it, the official `openai`
client (sync and async) and raw HTTP in front. Golden greedy chat, streaming framing, n > 1,
logprobs, stops, echo, token prompts, errors in OpenAI's shape, Prometheus metrics, aborts on
client disconnect (pages back in the pool), 32 concurrent streams, an engine failure, and
`jaxserve serve` as a subprocess stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.config import ServerConfig
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.http.app import attach_engine, build_app, start_server
from jaxserve.entrypoints.serving.streams import with_keepalive
from jaxserve.entrypoints.process import ServerProcess
from jaxserve.entrypoints.http.rag_routes import add_rag_routes
from tests.test_cli import ROOT, tiny_gguf
from tests.test_engine import assert_no_leaks

SMOLLM2 = "smollm2-135m-instruct"
GREEDY = {"temperature": 0, "max_tokens": 32}


class Reply(NamedTuple):
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def _request(method: str, url: str, json_body=None, content: bytes | None = None,
             headers: dict | None = None) -> Reply:
    """Raw HTTP with the standard library (no client of ours between the test and the server)."""
    data = json.dumps(json_body).encode() if json_body is not None else content
    req = urllib.request.Request(url, data=data, method=method, headers={
        **({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                         resp.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode())


def http_get(url: str) -> Reply:
    return _request("GET", url)


def http_post(url: str, body=None, content: bytes | None = None) -> Reply:
    return _request("POST", url, body, content)


class ServerThread:
    """The aiohttp app on its own event-loop thread (as `jaxserve serve` runs it), so the tests
    can use blocking clients too. Bound to 127.0.0.1 on a free port."""

    def __init__(self, model_name: str, rag=None, setup=None, **config):
        """`setup(app)`: what else to register before the server starts (admin routes)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # Stored responses and their background runs in a directory of this server's own, not
        # the default data directory every other server (and a user's) shares.
        config.setdefault("data_dir", tempfile.mkdtemp(prefix="jaxserve-data-"))
        self.app = build_app(ServerConfig(port=0, **config), model_name)
        self.rag = rag
        if rag is not None:  # a RagService: its routes too
            add_rag_routes(self.app, rag)
        if setup is not None:
            setup(self.app)
        self.runner, port = self._call(start_server(self.app, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def attach(self, engine: AsyncEngine) -> None:
        self.loop.call_soon_threadsafe(attach_engine, self.app, engine, self.rag)
        wait_for(lambda: http_get(f"{self.url}/ready").status_code == 200, "ready")

    def stop(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_for(predicate, what: str, deadline_s: float = 60.0):
    """Poll until predicate() is truthy; fail naming `what` after the deadline."""
    end = time.monotonic() + deadline_s
    while not (value := predicate()):
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)
    return value


def slowable(llm, delay_s: float) -> threading.Event:
    """An event that, while set, makes each of `llm`'s steps take `delay_s` longer: a window the
    test opens (a batch's deadline, a write timeout) then ends before the work does, on any host."""
    step, slow = llm.step, threading.Event()
    llm.step = lambda: (time.sleep(delay_s) if slow.is_set() else None, step())[1]
    return slow


def queueing_engine(model: str):
    """A tiny model's engine that runs one sequence at a time in 16-token steps, so a few
    requests queue behind it (degradation, shedding, usage under load)."""
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine

    return AsyncEngine(build_engine(model, num_pages=48, max_num_seqs=1,
                                    max_num_batched_tokens=16, max_model_len=128,
                                    min_token_bucket=16, progress=False))


def scrape(url: str) -> dict[str, float]:
    """/metrics as {sample name: value}; histogram buckets keep their `le` in the name."""
    resp = http_get(f"{url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            values[s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")] = s.value
    return values


def wait_idle(url: str) -> dict[str, float]:
    """Wait until /metrics shows no running or waiting request and no KV page held."""
    def idle():
        m = scrape(url)
        return m if (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:kv_cache_usage_perc"]
                     == 0 and m["jaxserve:num_requests_waiting"] == 0) else None
    return wait_for(idle, "the engine to go idle")


def access_records(caplog, count: int) -> list[dict] | None:
    """The access-log lines as dicts, once there are `count` of them."""
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "jaxserve.access"]
    assert len(records) <= count, records
    return records if len(records) == count else None


def parse_sse(raw: bytes) -> list:
    """A whole SSE body as its data payloads ("[DONE]" kept as a string); checks the framing."""
    events = raw.decode().split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    payloads = []
    for event in events[:-1]:
        if event.startswith(":"):  # keep-alive comment
            continue
        assert event.startswith("data: ") and "\n" not in event, event
        data = event[len("data: "):]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads and payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def finishes(chunks) -> dict[int, list[str]]:
    """Every non-null finish_reason per choice index, in order."""
    seen: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            if c.finish_reason is not None:
                seen.setdefault(c.index, []).append(c.finish_reason)
    return seen


# ---------------------------------------------------------------- pure helpers


def test_keepalive_fills_silence_and_stops_with_the_stream():
    async def slow():
        await asyncio.sleep(0.3)
        yield "a"
        yield "b"

    async def main():
        return [x async for x in with_keepalive(slow(), 0.01)]

    items = asyncio.run(main())
    assert items[-2:] == ["a", "b"] and None in items and set(items[:-2]) == {None}


def test_keepalive_forwards_an_error_and_closes_the_stream_its_reader_leaves():
    closed = []

    async def failing():
        yield "a"
        raise ValueError("engine said no")

    async def endless():
        try:
            while True:
                yield "x"
                await asyncio.sleep(0)
        finally:
            closed.append(True)  # where AsyncEngine.generate aborts the request

    async def main():
        got = []
        with pytest.raises(ValueError, match="engine said no"):
            async for x in with_keepalive(failing(), 10.0):
                got.append(x)
        async for x in with_keepalive(endless(), 10.0):
            break
        for _ in range(3):
            await asyncio.sleep(0)
        return got

    assert asyncio.run(main()) == ["a"] and closed == [True]


# ---------------------------------------------------------------- real SmolLM2 behind the server


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return build_engine(SMOLLM2, num_pages=256, max_num_seqs=32,
                        max_num_batched_tokens=256, max_model_len=512,
                        min_token_bucket=16, strict_compile=True, progress=False)


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(SMOLLM2)
    async_engine = AsyncEngine(engine)
    srv.attach(async_engine)
    yield srv
    srv.stop()
    async_engine.shutdown()
    assert engine.runner.num_serving_compiles == 0
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient_kwargs(server):
    return dict(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_cases(golden):
    return [c for c in golden["cases"] if "messages" in c["case"]]


def prompt_cases(golden):
    return [c for c in golden["cases"] if "prompt" in c["case"]]


@pytest.mark.slow
def test_golden_chat_sync_and_async_streaming(server, client, aclient_kwargs, smollm2_golden):
    cases = chat_cases(smollm2_golden)
    assert cases
    for case in cases:
        want = case["greedy_text"].replace("<|im_end|>", "")
        r = client.chat.completions.create(model=SMOLLM2, messages=case["case"]["messages"],
                                           **GREEDY)
        assert r.object == "chat.completion" and r.model == SMOLLM2 and len(r.choices) == 1
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
        assert r.choices[0].finish_reason == "stop"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
            len(case["input_ids"]), len(case["greedy_ids"]))

    async def stream(case):
        async with openai.AsyncOpenAI(**aclient_kwargs) as aclient:
            s = await aclient.chat.completions.create(
                model=SMOLLM2, messages=case["case"]["messages"], stream=True,
                stream_options={"include_usage": True}, **GREEDY)
            return [chunk async for chunk in s]

    for case in cases:
        chunks = asyncio.run(stream(case))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert len({c.id for c in chunks}) == 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == case["greedy_text"].replace("<|im_end|>", "")
        assert finishes(chunks) == {0: ["stop"]}
        # the usage chunk comes last, with no choices; earlier chunks carry usage null
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
            case["greedy_ids"])
        assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_completions_text_token_list_batch_echo_and_stream(server, client, engine,
                                                           smollm2_golden):
    cases = prompt_cases(smollm2_golden)
    # a batch of text prompts: choices in prompt order, each its golden greedy text
    r = client.completions.create(model=SMOLLM2, prompt=[c["case"]["prompt"] for c in cases],
                                  **GREEDY)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [c["greedy_text"] for c in cases]
    assert [c.finish_reason for c in r.choices] == ["length"] * 4
    assert r.usage.prompt_tokens == sum(len(c["input_ids"]) for c in cases)
    assert r.usage.completion_tokens == 4 * 32

    def head(case, k=8):
        return engine.tokenizer.decode(case["greedy_ids"][:k])

    # token-id prompts: one, and a batch
    r = client.completions.create(model=SMOLLM2, prompt=cases[1]["input_ids"], temperature=0,
                                  max_tokens=8)
    assert r.choices[0].text == head(cases[1])
    r = client.completions.create(model=SMOLLM2, prompt=[c["input_ids"] for c in cases],
                                  temperature=0, max_tokens=8)
    assert [c.text for c in r.choices] == [head(c) for c in cases]
    # echo puts the prompt before the completion, streamed or not
    case = cases[0]
    r = client.completions.create(model=SMOLLM2, prompt=case["case"]["prompt"], echo=True,
                                  temperature=0, max_tokens=8)
    assert r.choices[0].text == case["case"]["prompt"] + head(case)
    chunks = list(client.completions.create(model=SMOLLM2, prompt=case["case"]["prompt"],
                                            echo=True, stream=True, temperature=0, max_tokens=8))
    assert "".join(c.choices[0].text for c in chunks) == case["case"]["prompt"] + head(case)
    assert finishes(chunks) == {0: ["length"]} and all(c.usage is None for c in chunks)


@pytest.mark.slow
def test_stop_strings(server, client, smollm2_golden):
    fox = prompt_cases(smollm2_golden)[0]  # ' with a quick brown bear.\n\nThe original ...'
    assert fox["case"]["prompt"] == "The quick brown fox"
    r = client.completions.create(model=SMOLLM2, prompt="The quick brown fox",
                                  stop=["brown", "zzz"], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" with a quick ", "stop")
    # streamed, the text that could still become a stop string is held back, never sent
    chunks = list(client.completions.create(model=SMOLLM2, prompt="The quick brown fox",
                                            stop=".\n\nThe", stream=True, **GREEDY))
    full = fox["greedy_text"]
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(".\n\nThe")]
    assert finishes(chunks) == {0: ["stop"]}
    paris = chat_cases(smollm2_golden)[0]
    r = client.chat.completions.create(model=SMOLLM2, messages=paris["case"]["messages"],
                                       stop=[" Paris"], **GREEDY)
    assert r.choices[0].message.content == "The capital of France is"


@pytest.mark.slow
def test_logprobs_chat_and_completion_formats(server, client, smollm2_golden):
    paris = chat_cases(smollm2_golden)[0]
    r = client.chat.completions.create(model=SMOLLM2, messages=paris["case"]["messages"],
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(paris["greedy_ids"])
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)
    assert "".join(e.token for e in content[:-1]) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=SMOLLM2, messages=paris["case"]["messages"], logprobs=True, stream=True,
        **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs left out: none

    fox = prompt_cases(smollm2_golden)[0]
    few = {"temperature": 0, "max_tokens": 12}
    r = client.completions.create(model=SMOLLM2, prompt=fox["case"]["prompt"], logprobs=2, **few)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert fox["greedy_text"].startswith(r.choices[0].text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(12)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-5)
        assert top[tok] == pytest.approx(value, abs=1e-5)
    chunks = list(client.completions.create(model=SMOLLM2, prompt=fox["case"]["prompt"],
                                            logprobs=2, stream=True, **few))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] \
        == lp.tokens
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


@pytest.mark.slow
def test_n_choices_seeds_and_sampling_extras(server, client, smollm2_golden):
    paris = chat_cases(smollm2_golden)[0]
    kwargs = dict(model=SMOLLM2, messages=paris["case"]["messages"], n=3, temperature=1.0,
                  seed=7, max_tokens=6, extra_body={"ignore_eos": True, "top_k": 50})
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.completion_tokens == 18
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3  # each choice its own seed
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert finishes(chunks) == {0: ["length"], 1: ["length"], 2: ["length"]}
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks
                        if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    r = client.completions.create(model=SMOLLM2, prompt=["a", "b"], n=2, max_tokens=3,
                                  temperature=0.5, presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"min_p": 0.05, "repetition_penalty": 1.2,
                                              "min_tokens": 3})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12


@pytest.mark.slow
def test_models_tokenize_detokenize(server, client, smollm2_golden):
    assert [(m.id, m.object) for m in client.models.list().data] == [(SMOLLM2, "model")]
    fox = prompt_cases(smollm2_golden)[0]
    r = http_post(f"{server.url}/tokenize", {"model": SMOLLM2, "prompt": fox["case"]["prompt"]})
    assert r.status_code == 200
    assert r.json() == {"tokens": fox["input_ids"], "count": 4, "max_model_len": 512}
    paris = chat_cases(smollm2_golden)[0]
    r = http_post(f"{server.url}/tokenize", {"messages": paris["case"]["messages"]})
    assert r.json()["tokens"] == paris["input_ids"]
    r = http_post(f"{server.url}/detokenize", {"tokens": fox["input_ids"]})
    assert r.json() == {"prompt": "The quick brown fox"}
    r = http_post(f"{server.url}/detokenize", {"tokens": [1, 49152]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


_CHAT = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
# (path, body, status, param, code, words the message must contain)
_ERRORS = [
    ("/v1/chat/completions", {**_CHAT, "model": "gpt-4"}, 404, "model", "model_not_found", "gpt-4"),
    ("/v1/completions", {"model": "x", "prompt": "a"}, 404, "model", "model_not_found", "'x'"),
    ("/v1/chat/completions", {**_CHAT, "temperature": -1}, 400, "temperature", None, ">= 0"),
    ("/v1/chat/completions", {**_CHAT, "top_p": 2}, 400, "top_p", None, "(0, 1]"),
    ("/v1/chat/completions", {**_CHAT, "n": 0}, 400, "n", None, "at least 1"),
    ("/v1/chat/completions", {**_CHAT, "frobnicate": 1}, 400, "frobnicate", None, "Unrecognized"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 600}, 400, "max_tokens",
     "context_length_exceeded", "512"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": -5}, 400, "max_tokens", None, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": "ten"}, 400, "max_tokens", None, "integer"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": [7] * 600}, 400, "max_tokens",
     "context_length_exceeded", "600"),
    ("/v1/chat/completions", {**_CHAT, "messages": []}, 400, "messages", None, "non-empty"),
    ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages", None, "robot"),
    ("/v1/chat/completions", {**_CHAT, "temperature": "hot"}, 400, "temperature", None,
     "temperature"),
    ("/v1/chat/completions", {**_CHAT, "top_logprobs": 3}, 400, "top_logprobs", None,
     "logprobs"),
    ("/v1/chat/completions", {**_CHAT, "logit_bias": {"1": 5}}, 400, "logit_bias", None,
     "not supported"),
    ("/v1/chat/completions", {**_CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options", None, "stream"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": ""}, 400, "prompt", None, "empty"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": [1, 99999]}, 400, "prompt", None,
     "vocabulary"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "a", "logprobs": 21}, 400, "logprobs",
     None, "[0, 20]"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "a", "max_tokens": 0}, 400,
     "max_tokens", None, "echo"),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "a", "suffix": "z"}, 400, "suffix", None,
     "not supported"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_errors_are_openai_error_bodies(server, stream):
    for path, body, status, param, code, words in _ERRORS:
        # (stream_options is the error only while stream is off)
        r = http_post(f"{server.url}{path}",
                      body if "stream_options" in body else {**body, "stream": stream})
        assert r.status_code == status, (body, r.text)
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert err["type"] == "invalid_request_error" and words in err["message"], (body, err)
    for raw in (b"{not json", b"[1, 2]", "\u00e9".encode("latin-1")):
        r = http_post(f"{server.url}/v1/chat/completions", content=raw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    wait_idle(server.url)  # no rejected request left anything behind


@pytest.mark.slow
def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=_CHAT["messages"])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SMOLLM2, messages=_CHAT["messages"], max_tokens=600)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "512" in e.value.body["message"] and "600" in e.value.body["message"]


@pytest.mark.slow
def test_metrics_count_tokens_and_observe_histograms(server, client, smollm2_golden):
    before = wait_idle(server.url)
    fox = prompt_cases(smollm2_golden)[0]
    client.completions.create(model=SMOLLM2, prompt=fox["input_ids"], max_tokens=8,
                              temperature=0)
    list(client.completions.create(model=SMOLLM2, prompt=fox["input_ids"], max_tokens=8,
                                   temperature=0, stream=True))
    after = wait_idle(server.url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["jaxserve:generation_tokens_total"] == 16
    assert delta["jaxserve:prompt_tokens_total"] == 8
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta[f"jaxserve:{name}_count"] == 2, name
        assert delta[f"jaxserve:{name}_sum"] > 0, name
        assert after[f"jaxserve:{name}_bucket[+Inf]"] == after[f"jaxserve:{name}_count"]
    assert delta["jaxserve:inter_token_latency_seconds_count"] == 14  # 7 gaps per request
    for name in ("num_preemptions_total", "prefix_cache_hits_total",
                 "prefix_cache_queries_total", "kv_cache_cached_free_pages"):
        assert f"jaxserve:{name}" in after, name


async def _raw_stream_then_drop(url: str, body: dict, events: int) -> None:
    """Read `events` SSE events, then drop the connection without reading the rest."""
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{url}/v1/completions", json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen >= events:
                break
        resp.close()


@pytest.mark.slow
def test_client_disconnect_aborts_and_frees_pages(server, engine, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    body = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}
    before = wait_idle(server.url)
    asyncio.run(_raw_stream_then_drop(server.url, {**body, "stream": True}, 3))
    after = wait_idle(server.url)
    # the request was cut short, not run to its 400 tokens
    assert 3 <= after["jaxserve:generation_tokens_total"] - before[
        "jaxserve:generation_tokens_total"] < 400

    async def non_streaming_then_drop():
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(
                session.post(f"{server.url}/v1/completions", json=body))
            while scrape(server.url)["jaxserve:num_requests_running"] == 0:
                await asyncio.sleep(0.05)
            task.cancel()  # closes the connection while the server waits on the engine
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(non_streaming_then_drop())
    final = wait_idle(server.url)
    assert final["jaxserve:generation_tokens_total"] - after[
        "jaxserve:generation_tokens_total"] < 400
    # idle now: the pool's refcounts, free list and prefix cache agree
    engine.scheduler.cache.check_invariants()
    assert [r["status"] for r in wait_for(lambda: access_records(caplog, 2), "2 log lines")] == [
        "client_disconnected"] * 2


@pytest.mark.slow
def test_32_concurrent_streams_equal_their_greedy_outputs_alone(server, engine, smollm2_golden,
                                                                caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    cases = prompt_cases(smollm2_golden)
    tok = engine.tokenizer
    finished_before = engine.stats().num_requests_finished

    async def one(session, i):
        case = cases[i % len(cases)]
        async with session.post(f"{server.url}/v1/completions", json={
                "model": SMOLLM2, "prompt": case["input_ids"], "max_tokens": 16,
                "temperature": 0, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
            return i, parse_sse(await resp.read())

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(32)))

    for i, chunks in asyncio.run(main()):
        case = cases[i % len(cases)]
        assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(
            case["greedy_ids"][:16])
        reasons = [c["choices"][0]["finish_reason"] for c in chunks]
        assert reasons[-1] == "length" and reasons.count(None) == len(reasons) - 1
        assert len({c["id"] for c in chunks}) == 1
    wait_idle(server.url)
    assert engine.stats().num_requests_finished - finished_before == 32
    # one access-log line per request, with its numbers and no prompt text
    records = wait_for(lambda: access_records(caplog, 32), "32 access-log lines")
    assert {(r["status"], r["completion_tokens"], tuple(r["finish_reasons"])) for r in records} \
        == {("ok", 16, ("length",))}
    assert all(r["ttft_s"] is not None and "prompt" not in r for r in records)


# ---------------------------------------------------------------- tiny model: warmup and failure


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)


def test_warmup_then_ready_then_engine_failure(tiny_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxserve.access")
    srv = ServerThread("tiny", keepalive_seconds=0.001, log_prompts=True)
    try:
        # before the engine attaches: alive, not ready, generation refused with 503
        assert http_get(f"{srv.url}/health").json() == {"status": "ok"}
        assert http_get(f"{srv.url}/ready").status_code == 503
        r = http_post(f"{srv.url}/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "jaxserve:num_requests_running" not in scrape(srv.url)
        # 5 usable pages of 16 tokens: less than the 128-token context
        llm_engine = build_engine(str(tiny_path), num_pages=6, max_num_seqs=4,
                                  max_num_batched_tokens=32, max_model_len=128,
                                  min_token_bucket=16, strict_compile=True,
                                  progress=False)
        engine = AsyncEngine(llm_engine)
        srv.attach(engine)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        # keep-alive comments every millisecond do not disturb the client's SSE parsing
        chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert finishes(chunks) == {0: ["length"]}
        # --log-prompts puts the prompt in the access-log line
        assert wait_for(lambda: access_records(caplog, 1), "an access-log line")[0]["prompt"] == [
            "hi"]
        # Without max_tokens a chat answer may run to what the pool holds (80 tokens), not a 400.
        r = client.chat.completions.create(model="tiny", messages=_CHAT["messages"],
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 80
        r = http_post(f"{srv.url}/v1/chat/completions",
                      {**_CHAT, "model": "tiny", "max_tokens": 60})
        assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]
        # A request must fit the pool as a whole: two 40-token sequences need 6 of the 5 pages,
        # whether they are n = 2 choices or two prompts; one of them fits.
        for fields, param in (({"prompt": [5] * 20, "n": 2}, "n"),
                              ({"prompt": [[5] * 20, [6] * 20]}, "prompt")):
            r = http_post(f"{srv.url}/v1/completions", {"model": "tiny", "max_tokens": 20,
                                                        **fields})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, err
            assert "needs 6 KV pages for its 2 sequences but the pool has 5" in err["message"]
        r = http_post(f"{srv.url}/v1/completions", {"model": "tiny", "prompt": [5] * 20,
                                                    "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        # Without max_tokens, n chat choices share the pool: 2 pages (32 tokens) each.
        r = client.chat.completions.create(model="tiny", messages=[{"role": "system",
                                                                    "content": "x"}], n=2,
                                           extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens + r.usage.completion_tokens // 2 == 32

        # One request failing on its own (here: its host-side token handling) is a 500 for that
        # request only; the next request is served.
        on_token = llm_engine.output_processor._on_token

        def fail_one(group, seq, *args):
            if group.prepared.params.seed == 666:
                raise RuntimeError("injected request failure")
            return on_token(group, seq, *args)

        llm_engine.output_processor._on_token = fail_one
        r = http_post(f"{srv.url}/v1/completions",
                      {"model": "tiny", "prompt": "hi", "max_tokens": 3, "seed": 666})
        assert r.status_code == 500 and "injected request failure" in r.json()["error"]["message"]
        r = http_post(f"{srv.url}/v1/completions", {"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert http_get(f"{srv.url}/ready").status_code == 200

        def fail(*args, **kwargs):
            raise RuntimeError("injected device failure")

        # A failing step kills the engine (its cache state is unknown); the server stays up,
        # says so on /ready, and answers each request with an error instead of hanging.
        llm_engine.runner.forward = fail
        with pytest.raises(openai.APIError, match="engine step failed"):
            list(client.completions.create(model="tiny", prompt="hi", max_tokens=5,
                                           stream=True))
        r = http_post(f"{srv.url}/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        assert http_get(f"{srv.url}/health").status_code == 200
        assert http_get(f"{srv.url}/ready").status_code == 503
        assert "jaxserve:num_requests_running" in scrape(srv.url)
        engine.shutdown()
    finally:
        srv.stop()


def test_full_queue_is_a_503_before_any_stream_starts(tiny_path, monkeypatch):
    """--max-queued-requests 1 with one sequence slot: while one request runs and one waits, a
    third is refused with 503 `overloaded`, streaming or not (never a 200 with an error event);
    the two accepted ones finish, and later the same request is served."""
    llm_engine = build_engine(str(tiny_path), num_pages=40, max_num_seqs=1,
                              max_num_batched_tokens=32, max_model_len=128,
                              min_token_bucket=16, strict_compile=True, progress=False)
    # Hold the engine loop once a request runs, until the refusals are checked: the queue then
    # stays full however fast the tiny model is.
    release, step = threading.Event(), llm_engine.step
    monkeypatch.setattr(llm_engine, "step", lambda: (
        release.wait(60) if llm_engine.stats().num_running else None, step())[1])
    engine = AsyncEngine(llm_engine)
    srv = ServerThread("tiny", max_queued_requests=1)
    replies, holders = [], []
    try:
        srv.attach(engine)

        def hold():  # a streaming request, read to its end on its own thread
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 20, "ignore_eos": True,
                    "stream": True}
            t = threading.Thread(target=lambda: replies.append(
                http_post(f"{srv.url}/v1/completions", body)))
            t.start()
            holders.append(t)

        hold()  # runs, holding the only slot
        wait_for(lambda: engine.stats().num_running == 1, "the first request to run")
        hold()  # waits
        wait_for(lambda: engine.num_queued == 1, "the second request to queue")
        for stream in (True, False):
            r = http_post(f"{srv.url}/v1/completions",
                          {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": stream})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "overloaded"
            assert "queue is full" in r.json()["error"]["message"]
        release.set()
        for t in holders:
            t.join(60)
        assert [r.status_code for r in replies] == [200, 200]
        # (payloads, not bytes: the random model may stream the token "error")
        assert not any("error" in p for r in replies for p in parse_sse(r.text.encode()))
        r = http_post(f"{srv.url}/v1/completions",
                      {"model": "tiny", "prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        release.set()
        srv.stop()
        engine.shutdown()
    assert_no_leaks(llm_engine)


# ---------------------------------------------------------------- `jaxserve serve` subprocess


@pytest.mark.slow
def test_serve_subprocess_chat_then_sigterm(smollm2_path, smollm2_golden, tmp_path):
    log_path = tmp_path / "stderr.log"
    with log_path.open("w") as stderr:
        server = ServerProcess(["--model", SMOLLM2, "--port", "0", "--max-model-len", "512",
                                "--num-pages", "64", "--max-num-seqs", "4",
                                "--max-num-batched-tokens", "64", "--min-token-bucket", "16",
                                "--data-dir", str(tmp_path / "rag")], stderr, cwd=ROOT,
                               ready_timeout_s=300)
        try:
            assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/v1")
            case = chat_cases(smollm2_golden)[0]
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            r = client.chat.completions.create(model=SMOLLM2, messages=case["case"]["messages"],
                                               **GREEDY)
            assert r.choices[0].message.content == case["greedy_text"].replace("<|im_end|>", "")
            # Retrieval is served beside the LLM from --data-dir: a collection, then a cited chat.
            base = server.url.removesuffix("/v1")
            for path, body in (("/v1/collections", {"name": "geo"}),
                               ("/v1/collections/geo/documents", {"documents": [
                                   {"id": "fr", "text": "Paris is the capital of France."},
                                   {"id": "bake", "text": "Knead the dough, let it rise."}]})):
                with urllib.request.urlopen(urllib.request.Request(
                        base + path, json.dumps(body).encode(), method="POST",
                        headers={"Content-Type": "application/json"}), timeout=120) as resp:
                    assert resp.status in (200, 201)
            r = client.chat.completions.create(model=SMOLLM2, messages=case["case"]["messages"],
                                               extra_body={"rag": {"collection": "geo",
                                                                   "top_k": 1}}, **GREEDY)
            assert r.model_extra["citations"][0]["document_id"] == "fr"
            assert server.stop() == 0
        finally:
            server.kill()
    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    access = [json.loads(line.split("jaxserve.access: ", 1)[1]) for line in log.splitlines()
              if "jaxserve.access: " in line]
    assert len(access) == 2 and {a["status"] for a in access} == {"ok"}
    assert access[0]["finish_reasons"] == ["stop"]
    assert case["case"]["messages"][0]["content"] not in log  # no prompt text in the logs

"""Prompt log-probabilities (SamplingParams.prompt_logprobs) on SmolLM2's real weights, in float32,
against HF transformers' (tests/fixtures/prompt_logprobs_smollm2.json, written by
tools/make_prompt_logprobs_fixture.py): every prompt token within 1e-3 nats, alone and inside a
full batch, with chunked prefill splitting the prompt, after a prefix-cache hit on that prompt,
and with n-gram speculative decoding verifying drafts in the same steps. Then the same engine
behind the HTTP server: completions' `echo` with `logprobs` (OpenAI's legacy shape, token-id
prompts, batches, streamed, `max_tokens` 0), vLLM's `prompt_logprobs` on completions and chat,
and /tokenize, /detokenize, /tokenizer_info (lm-eval's own probe of them). The engine runs with
strict_compile: scoring compiles nothing while serving."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.core.async_engine import AsyncEngine
from tests.conftest import GOLDEN_DIR
from tests.test_server import ServerThread, http_get, http_post

pytestmark = pytest.mark.slow

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "prompt_logprobs_smollm2.json")
                     .read_text())
PROMPTS = FIXTURE["prompts"]
GOLDEN_CHATS = [{"messages": c["case"]["messages"], "input_ids": c["input_ids"]}
                for c in json.loads((GOLDEN_DIR / "smollm2_golden.json").read_text())["cases"]
                if "messages" in c["case"]]
TOLERANCE = 1e-3  # nats
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    """32 tokens a step: prompts of up to 32 tokens run whole, longer ones in chunks (the
    74-token one in 3 steps alone, more in a batch); the prefix cache and n-gram speculation on.
    One engine for every test here: its warmup is most of this module's time."""
    return LLM(SMOLLM2, dtype="float32", num_pages=96, max_num_seqs=8, max_num_batched_tokens=32,
               max_model_len=256, min_token_bucket=16, enable_prefix_caching=True,
               speculative_ngram=3, strict_compile=True, progress=False)


def score(llm, prompts, k=2, max_tokens=1):
    outs = llm.generate([{"prompt_token_ids": p["input_ids"]} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=k))
    return [o.prompt_logprobs for o in outs]


def check_against_hf(prompt, got, k=2) -> float:
    """The largest difference from HF's; asserts the shape of every entry."""
    ids = prompt["input_ids"]
    assert len(got) == len(ids) and got[0] is None
    worst = 0.0
    for pos, (entry, ref) in enumerate(zip(got[1:], prompt["logprobs"]), start=1):
        assert entry.token_id == ids[pos]
        assert len(entry.top) == k and entry.top[0][1] >= entry.top[1][1]
        assert (entry.rank == 1) == (entry.top[0][0] == ids[pos]), (pos, entry)
        worst = max(worst, abs(entry.logprob - ref))
    assert worst <= TOLERANCE, f"prompt of {len(ids)} tokens: off by {worst}"
    return worst


def test_every_prompt_token_equals_hf_alone_and_in_a_full_batch(llm):
    alone = [score(llm, [p])[0] for p in PROMPTS]
    for p, got in zip(PROMPTS, alone):
        check_against_hf(p, got)
        # HF's argmax is the engine's top token wherever HF is not torn between two
        assert sum(e.top[0][0] == a for e, a in zip(got[1:], p["argmax"])) >= len(got) - 2
    batched = score(llm, PROMPTS)  # 173 tokens: full steps of several prompts
    for p, got in zip(PROMPTS, batched):
        check_against_hf(p, got)
    spread = max(abs(a.logprob - b.logprob) for x, y in zip(alone, batched)
                 for a, b in zip(x[1:], y[1:]))
    print(f"largest difference, alone vs in a full batch: {spread:.3g} nats")
    assert spread <= TOLERANCE


def test_chunked_prefill_and_speculation_score_every_position(llm):
    # A repetitive prompt decoding beside them, so n-gram drafts are verified in the same steps.
    echo = {"input_ids": PROMPTS[-1]["input_ids"][:12] * 2}
    drafts_before = llm.engine.stats().num_draft_tokens
    outs = llm.generate(
        [{"prompt_token_ids": echo["input_ids"]}]
        + [{"prompt_token_ids": p["input_ids"]} for p in PROMPTS],
        [SamplingParams(max_tokens=24, temperature=0)]
        + [SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2)] * len(PROMPTS))
    assert outs[0].prompt_logprobs is None
    for p, out in zip(PROMPTS, outs[1:]):
        check_against_hf(p, out.prompt_logprobs)
    assert llm.engine.stats().num_draft_tokens > drafts_before, "no draft was verified"


def test_a_prefix_cache_hit_does_not_skip_scored_positions(llm):
    long = {"prompt_token_ids": PROMPTS[-1]["input_ids"]}
    llm.generate([long], SamplingParams(max_tokens=1))  # its pages now cached
    warm = llm.generate([long], SamplingParams(max_tokens=1))[0]
    assert warm.num_cached_tokens >= 64, "the prefix cache did not hold the prompt"
    scored = llm.generate([long], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0  # computed whole, so every position is scored
    check_against_hf(PROMPTS[-1], scored.prompt_logprobs)


def test_n_sequences_share_one_scoring(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]["input_ids"]}],
                             SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1,
                                            prompt_logprobs=0))[0]
    assert len(out.outputs) == 3
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    worst = max(abs(e.logprob - r) for e, r in zip(out.prompt_logprobs[1:],
                                                  PROMPTS[0]["logprobs"]))
    assert worst <= TOLERANCE


# ---- the same engine behind the HTTP server (after the tests above: it steps on its own) -----


@pytest.fixture(scope="module")
def server(llm):
    srv = ServerThread(SMOLLM2)
    async_engine = AsyncEngine(llm.engine)
    srv.attach(async_engine)
    yield srv
    srv.stop()
    async_engine.shutdown()
    assert llm.engine.runner.num_serving_compiles == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def check_echo(prompt, logprobs, generated: int, k: int = 1) -> None:
    """OpenAI's legacy echo: the prompt's tokens (the first without a logprob), then the
    generated ones; offsets from 0 into the text."""
    n = len(prompt["input_ids"])
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == n + generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    worst = max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:n], prompt["logprobs"]))
    assert worst <= TOLERANCE
    assert all(len(t) == k for t in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_completions_echo_logprobs_of_token_prompts_in_a_batch(client):
    chosen = [PROMPTS[1], PROMPTS[-1]]
    r = client.completions.create(model=SMOLLM2, prompt=[p["input_ids"] for p in chosen],
                                  echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert len(r.choices) == 2
    for p, choice in zip(chosen, sorted(r.choices, key=lambda c: c.index)):
        check_echo(p, choice.logprobs, generated=1)
        assert choice.logprobs.token_logprobs[-1] is not None  # the generated token's
    assert r.usage.completion_tokens == 2


def test_max_tokens_0_scores_a_text_prompt_without_generating(client):
    text = "The capital of France is Paris"
    r = client.completions.create(model=SMOLLM2, prompt=text, echo=True, logprobs=0,
                                  max_tokens=0)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens
    assert "".join(choice.logprobs.tokens) == text
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_streamed_echo_logprobs_equal_the_whole_answer(client):
    p = PROMPTS[2]
    whole = client.completions.create(model=SMOLLM2, prompt=p["input_ids"], echo=True,
                                      logprobs=2, max_tokens=3, temperature=0).choices[0]
    tokens, lps, offsets, text = [], [], [], ""
    for chunk in client.completions.create(model=SMOLLM2, prompt=p["input_ids"], echo=True,
                                           logprobs=2, max_tokens=3, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert (tokens, lps, offsets) == (whole.logprobs.tokens, whole.logprobs.token_logprobs,
                                      whole.logprobs.text_offset)
    check_echo(p, whole.logprobs, generated=3, k=2)


def vllm_shape(prompt, prompt_logprobs, k: int) -> None:
    ids = prompt["input_ids"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for pos, (entry, ref) in enumerate(zip(prompt_logprobs[1:], prompt["logprobs"]), start=1):
        own = entry[str(ids[pos])]
        assert abs(own["logprob"] - ref) <= TOLERANCE
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        assert k <= len(entry) <= k + 1
        assert {e["rank"] for t, e in entry.items() if t != str(ids[pos])} <= set(range(1, k + 1))


def test_vllm_prompt_logprobs_on_completions_and_chat(server):
    p = PROMPTS[0]  # a golden chat prompt, rendered
    r = http_post(f"{server.url}/v1/completions", {
        "model": SMOLLM2, "prompt": p["input_ids"], "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    vllm_shape(p, r.json()["choices"][0]["prompt_logprobs"], 2)
    messages = [c for c in GOLDEN_CHATS if c["input_ids"] == p["input_ids"]][0]["messages"]
    r = http_post(f"{server.url}/v1/chat/completions", {
        "model": SMOLLM2, "messages": messages, "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    vllm_shape(p, r.json()["prompt_logprobs"], 1)
    r = http_post(f"{server.url}/v1/chat/completions", {
        "model": SMOLLM2, "messages": messages, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_tokenizer_routes_in_vllms_shapes(server):
    from lm_eval.utils import check_remote_tokenizer_support

    info = http_get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 256
    assert "im_start" in info["chat_template"]
    r = http_post(f"{server.url}/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                             "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and "".join(r["token_strs"]) == "Hello world"
    assert http_post(f"{server.url}/detokenize", {"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    # lm-eval's probe that picks its "remote" tokenizer backend
    assert check_remote_tokenizer_support(f"{server.url}/v1/completions")
    too_long = http_post(f"{server.url}/tokenize", {"prompt": "a" * ((1 << 20) + 1)})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    too_many = http_post(f"{server.url}/detokenize", {"tokens": [1] * ((1 << 17) + 1)})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "tokens"
    r = http_get(f"{server.url}/tokenizer_info?model=nope")
    assert r.status_code == 404, r.text

"""Speculative decoding (n-gram drafts): the proposer, its settings, and the engine's outputs
with speculation equal to those without it (greedy, seeded sampling, logprobs, stops, n > 1,
structured outputs, preemption, prefix caching), on a tiny random model with an oracle drafter
(so that drafts stand and fall in known proportions) and on SmolLM2 against the HF golden
outputs with the real n-gram drafts."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.entrypoints.llm import LLM
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.speculation import NgramProposer, propose_ngram
from jaxserve.structured import StructuredOutputsParams as SO
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_golden, assert_no_leaks, count_compiles, golden_prompts

SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------- the proposer and its settings


def test_propose_ngram_takes_the_longest_then_most_recent_match():
    a = np.array
    # suffix [1, 2] occurred at 0 (followed by 3, 4) and at 5 (followed by 9): most recent wins
    assert propose_ngram(a([1, 2, 3, 4, 0, 1, 2, 9, 8, 1, 2]), 3, 1, 3).tolist() == [9, 8, 1]
    # a longer match beats a more recent shorter one: [7, 1, 2] occurred only at 0
    assert propose_ngram(a([7, 1, 2, 5, 1, 2, 6, 7, 1, 2]), 2, 1, 3).tolist() == [5, 1]
    # k caps the draft; the end of the history caps it too
    assert propose_ngram(a([4, 5, 6, 4]), 5, 1, 2).tolist() == [5, 6, 4]
    # nothing repeats, or the repeat is shorter than min_n
    assert propose_ngram(a([1, 2, 3, 4]), 3, 1, 3).tolist() == []
    assert propose_ngram(a([1, 2, 3, 1]), 3, 2, 3).tolist() == []
    assert propose_ngram(a([5]), 3, 1, 3).tolist() == []
    assert NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4,
                                           prompt_lookup_min=1)).propose(
        [1, 2, 3, 1, 2], 9) == [3, 1]
    # the default lookup needs 3 matching tokens
    assert NgramProposer(SpeculativeConfig()).propose([1, 2, 3, 1, 2], 9) == []
    assert NgramProposer(SpeculativeConfig()).propose([1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2, 3]


def test_speculative_config_follows_vllm():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_max": 5}') == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=5)
    c = SpeculativeConfig()
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == SpeculativeConfig.DEFAULT_PROMPT_LOOKUP
    for bad, match in [({"method": "eagle"}, "must be 'ngram'"),
                       ({"num_speculative_tokens": 0}, ">= 1"),
                       ({"num_speculative_tokens": 16}, "<= 15"),
                       ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "must not exceed"),
                       ({"draft_model": "x"}, "unknown fields")]:
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculativeConfig.parse("{")
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


# ---------------------------------------------------------------- engine: tiny random model


class OracleDrafter:
    """Proposes what the reference run generated after the same history, with about one draft
    in three made wrong (fixed by the history), so each step sees drafts stand and fall."""

    def __init__(self, references: list[list[int]], k: int):
        self.references, self.k = references, k
        self.calls = 0

    def propose(self, token_ids, n):
        self.calls += 1
        history = list(token_ids)
        for ref in self.references:
            if len(ref) > len(history) and ref[:len(history)] == history:
                truth = ref[len(history):len(history) + min(n, self.k)]
                return [(t + 1) % 49152 if zlib.crc32(bytes(str(len(history) + j), "ascii")) % 3
                        == 0 else t for j, t in enumerate(truth)]
        return []


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)
    # 15 usable pages of 8 tokens: a few long sequences at once already preempt.
    return LLM(str(path), num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=128, speculative_ngram=3, strict_compile=True, progress=False)


def _references(outs) -> list[list[int]]:
    return [list(o.prompt_token_ids) + list(c.token_ids) for o in outs for c in o.outputs]


def _same(ref, got) -> None:
    for a, b in zip(ref, got, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids, y.text, y.finish_reason, y.stop_reason)
            if x.logprobs is not None:
                assert [t for lp in x.logprobs for t, _ in lp.top] == [
                    t for lp in y.logprobs for t, _ in lp.top]
                np.testing.assert_allclose([lp.logprob for lp in x.logprobs],
                                           [lp.logprob for lp in y.logprobs], atol=1e-4)


def test_outputs_equal_the_plain_engines_with_drafts_right_and_wrong(tiny_llm, monkeypatch):
    """The same requests with speculation opted out (num_speculative_tokens=0: the plain path)
    and with an oracle drafter: identical tokens, texts, finish and stop reasons, logprobs;
    stop strings and stop tokens inside accepted drafts cut the output there; max_tokens is
    never passed; pages come back; nothing compiles after warmup."""
    engine = tiny_llm.engine
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 50 for j in range(6 + 9 * i)]}
               for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [greedy, greedy.replace(logprobs=3, max_tokens=33),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True,
                             n=2, logprobs=2),
              SamplingParams(temperature=1.2, top_k=50, seed=5, max_tokens=25, min_tokens=10,
                             ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
              greedy.replace(max_tokens=21)]
    plain = [p.replace(num_speculative_tokens=0) for p in params]
    with count_compiles() as compiles:
        ref = tiny_llm.generate(prompts, plain)
        assert engine.stats().num_draft_tokens == 0
        drafter = OracleDrafter(_references(ref), k=3)
        monkeypatch.setattr(engine, "proposer", drafter)
        got = tiny_llm.generate(prompts, params)
        _same(ref, got)
        stats = engine.stats()
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
        assert stats.num_preemptions > 0  # the small pool preempted mid-speculation too
        # Stops inside a run of accepted drafts: a stop string, a stop token, max_tokens.
        text = ref[0].outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        ids = ref[0].outputs[0].token_ids
        cut = [greedy.replace(stop=[stop]), greedy.replace(stop_token_ids=[ids[17]]),
               greedy.replace(max_tokens=13)]
        ref_cut = tiny_llm.generate([prompts[0]] * 3,
                                    [p.replace(num_speculative_tokens=0) for p in cut])
        _same(ref_cut, tiny_llm.generate([prompts[0]] * 3, cut))
        assert ref_cut[0].outputs[0].stop_reason == stop
        assert len(ref_cut[1].outputs[0].token_ids) <= 18
        # One request's opt-out holds while others speculate.
        calls = drafter.calls
        tiny_llm.generate(prompts[0], greedy.replace(num_speculative_tokens=0))
        assert drafter.calls == calls
    assert compiles() == 0 and engine.runner.num_serving_compiles == 0
    assert_no_leaks(engine)


def test_structured_outputs_and_prefix_cache_with_real_ngram_drafts(tiny_llm):
    """The real n-gram drafter on a constrained request (JSON repeats its own keys and
    separators, so drafts come) and on a prompt served from the prefix cache: the outputs equal
    the non-speculative ones, drafts the grammar forbids are rejected, the matcher ends where
    the output does."""
    engine = tiny_llm.engine
    schema = {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"], "additionalProperties": False}, "maxItems": 6}},
        "required": ["items"], "additionalProperties": False}
    prompt = {"prompt_token_ids": list(range(200, 240))}
    cases = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=SO(json=schema)),
             SamplingParams(seed=4, max_tokens=80, structured_outputs=SO(json=schema)),
             SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
    for i, params in enumerate(cases):
        ref = tiny_llm.generate(prompt, params.replace(num_speculative_tokens=0))
        before = engine.stats()
        got = tiny_llm.generate(prompt, params)  # the prompt's pages are cached by now
        after = engine.stats()
        assert got[0].num_cached_tokens > 0
        _same(ref, got)
        if i == 0:  # the greedy JSON: drafts came, some stood, some fell
            drafted = after.num_draft_tokens - before.num_draft_tokens
            stood = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
            assert 0 < stood < drafted
    assert_no_leaks(engine)


# ---------------------------------------------------------------- SmolLM2 vs the HF golden


@pytest.mark.slow
def test_smollm2_golden_and_input_grounded_output_with_ngram_drafts(smollm2_path, smollm2_golden):
    # Steps of at least 8 tokens: a decode verifying its 4 drafts (5 tokens) takes that bucket
    # whatever the smallest, and each bucket below it is one more forward, and one more row
    # count of samplers, to compile.
    llm = LLM(SMOLLM2, num_pages=256, max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=512, min_token_bucket=8, speculative_ngram=4, strict_compile=True,
              progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    for prompt, case in zip(golden_prompts(smollm2_golden), smollm2_golden["cases"]):
        assert_golden(llm.generate(prompt, greedy), {"cases": [case]})  # batch 1: most drafts
    assert_golden(llm.generate(golden_prompts(smollm2_golden), greedy), smollm2_golden)
    tok = llm.get_tokenizer()
    passage = ("The quick brown fox jumps over the lazy dog. The dog wakes up and chases the fox "
               "across the field, but the fox is faster and escapes into the forest.")
    prompt = tok.apply_chat_template([{"role": "user", "content":
                                       f"Repeat this text exactly:\n\n{passage}"}],
                                      add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=48)
    ref = llm.generate({"prompt_token_ids": prompt}, params.replace(num_speculative_tokens=0))
    drafts = llm.engine.stats().num_accepted_draft_tokens
    got = llm.generate({"prompt_token_ids": prompt}, params)
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.engine.stats().num_accepted_draft_tokens - drafts >= 10  # it copies the passage
    assert llm.engine.runner.num_serving_compiles == 0
    assert_no_leaks(llm.engine)


# ---------------------------------------------------------------- per request, over HTTP


def test_http_num_speculative_tokens_opts_out_caps_and_is_bounded(tmp_path,
                                                                  smollm2_tokenizer_fields):
    """On a server with --speculative-ngram 3: num_speculative_tokens 0 gives the same greedy
    output with no drafts counted; above the server's K it is capped (same output); outside
    0..15 (or not an integer) it is a 400 naming the field."""
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from tests.test_server import ServerThread, http_post, wait_idle

    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    engine = build_engine(str(path), num_pages=40, max_num_seqs=2,
                          max_num_batched_tokens=32, max_model_len=128, min_token_bucket=16,
                          # 1-token matches too: the random model repeats single tokens
                          speculative_config={"num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 4,
                                                      "prompt_lookup_min": 1},
                          strict_compile=True, progress=False)
    async_engine = AsyncEngine(engine)
    srv = ServerThread("tiny")
    try:
        srv.attach(async_engine)

        def drafts() -> float:
            return wait_idle(srv.url)["jaxserve:spec_decode_num_draft_tokens_total"]

        # 40 tokens of this random model after this prompt repeat a few earlier ones: the n-gram
        # drafter proposes. Both routes build SamplingParams in one place (server.protocol).
        routes = {"completions": ({"prompt": [5, 6, 7, 8] * 6}, lambda r: r["choices"][0]["text"]),
                  "chat/completions": ({"messages": [{"role": "user", "content": "ab ab ab ab"}]},
                                       lambda r: r["choices"][0]["message"]["content"])}
        for route, (prompt, text) in routes.items():
            body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                    **prompt}
            before = drafts()
            r = http_post(f"{srv.url}/v1/{route}", body)
            assert r.status_code == 200, r.text
            speculated = drafts()
            if route == "completions":  # (the chat prompt happens to draw no n-gram match)
                assert speculated > before, "the default request should have been given drafts"
            r_off = http_post(f"{srv.url}/v1/{route}", {**body, "num_speculative_tokens": 0})
            assert r_off.status_code == 200 and text(r_off.json()) == text(r.json())
            assert drafts() == speculated
            r_cap = http_post(f"{srv.url}/v1/{route}", {**body, "num_speculative_tokens": 15})
            assert r_cap.status_code == 200 and text(r_cap.json()) == text(r.json())
            for bad in (16, -1, "2", 1.5):
                err = http_post(f"{srv.url}/v1/{route}", {**body, "num_speculative_tokens": bad})
                assert err.status_code == 400, (bad, err.text)
                assert err.json()["error"]["param"] == "num_speculative_tokens", err.text
    finally:
        srv.stop()
        async_engine.shutdown()
    assert engine.runner.num_serving_compiles == 0
    assert_no_leaks(engine)

"""Async scheduling (SchedulerConfig.async_scheduling): step N+1 launched before step N's tokens
are read. The same tokens as without it (greedy, seeded, constrained, penalised rows, chunked
prefill, preemption), stops / max_tokens / aborts exact, every page back, no compile."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core.engine_factory import build_engine
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.structured.params import StructuredOutputsParams as SO
from tests.test_engine import assert_no_leaks, count_compiles
from tests.test_cli import tiny_gguf


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)
    # 15 pages of 16 tokens for up to 4 sequences: the long requests below preempt.
    return build_engine(str(path), num_pages=16, max_num_seqs=4, max_num_batched_tokens=32,
                        max_model_len=128, page_size=16, strict_compile=True, progress=False)


def _set_async(engine, on: bool) -> None:
    scheduler = dataclasses.replace(engine.config.scheduler, async_scheduling=on)
    engine.config = dataclasses.replace(engine.config, scheduler=scheduler)


def _run(engine, requests, on: bool, abort_at: dict[str, int] | None = None) -> dict:
    """Run requests to the end; abort_at: abort a request once it has shown that many tokens.
    Returns each request's final output; checks one final output each and no leaked pages."""
    _set_async(engine, on)
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    finals = {}
    with count_compiles() as compiles:
        while engine.has_unfinished():
            for out in engine.step():
                assert all(t >= 0 for c in out.outputs for t in c.token_ids)  # no placeholder
                if out.finished:
                    assert out.request_id not in finals
                    finals[out.request_id] = out
                elif abort_at and len(out.outputs[0].token_ids) == abort_at.get(out.request_id):
                    engine.abort(out.request_id)
        assert compiles() == 0
    assert_no_leaks(engine)
    return finals


def _prompt(i: int, n: int) -> list[int]:
    return [200 + (31 * i + 7 * j) % 5000 for j in range(n)]


def test_same_tokens_with_and_without_async_scheduling(engine):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = [
        ("greedy-short", _prompt(0, 5), greedy),
        ("greedy-long-prompt", _prompt(1, 70), greedy),  # chunked over 3 steps
        ("greedy-many", _prompt(2, 20), SamplingParams(temperature=0, max_tokens=100,
                                                       ignore_eos=True)),
        ("seeded-n", _prompt(3, 12), SamplingParams(n=2, seed=5, max_tokens=30, logprobs=2,
                                                    ignore_eos=True)),
        ("penalised", _prompt(4, 9), SamplingParams(temperature=0, max_tokens=30,
                                                    repetition_penalty=1.3, ignore_eos=True)),
        ("constrained", _prompt(5, 6), SamplingParams(
            seed=3, max_tokens=20, structured_outputs=SO(regex=r"[a-z]{2,6}-\d{2}"))),
        ("min-tokens", _prompt(6, 8), SamplingParams(seed=9, min_tokens=10, max_tokens=25)),
    ]
    off = _run(engine, requests, on=False)
    queued, preempted = engine.gaps.num_queued_ahead, engine.stats().num_preemptions
    on = _run(engine, requests, on=True)
    for rid in off:
        a, b = off[rid].outputs, on[rid].outputs
        assert [(c.token_ids, c.text, c.finish_reason) for c in a] == \
            [(c.token_ids, c.text, c.finish_reason) for c in b], rid
        # Batches differ between the runs (another order of steps), so the floats may move.
        assert [lp.logprob for c in a for lp in c.logprobs or ()] == pytest.approx(
            [lp.logprob for c in b for lp in c.logprobs or ()], abs=1e-3), rid
    assert len(on["greedy-many"].outputs[0].token_ids) == 100
    assert engine.gaps.num_queued_ahead > queued  # steps did overlap
    assert engine.stats().num_preemptions > preempted > 0  # the pool was short in both runs


def test_stops_max_tokens_and_aborts_are_exact_with_async_scheduling(engine):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [free] = _run(engine, [("free", _prompt(7, 10), greedy)], on=True).values()
    tokens, text = free.outputs[0].token_ids, free.outputs[0].text
    stop_token = tokens[12]
    first = tokens.index(stop_token)  # the stop token ends at its first occurrence
    stop_text = text[len(text) // 2:len(text) // 2 + 3]
    requests = [
        ("stop-token", _prompt(7, 10), greedy.replace(stop_token_ids=(stop_token,))),
        ("stop-string", _prompt(7, 10), greedy.replace(stop=[stop_text])),
        ("max-tokens", _prompt(7, 10), greedy.replace(max_tokens=7)),
        ("one-token", _prompt(7, 10), greedy.replace(max_tokens=1)),
        ("aborted", _prompt(8, 10), greedy),
        ("aborted-n", _prompt(9, 10), greedy.replace(n=2, temperature=1.0, seed=2)),
    ]
    finals = _run(engine, requests, on=True, abort_at={"aborted": 5, "aborted-n": 3})
    out = finals["stop-token"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == tokens[:first + 1]
    out = finals["stop-string"].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop_text)]
    assert finals["max-tokens"].outputs[0].token_ids == tokens[:7]
    assert finals["one-token"].outputs[0].token_ids == tokens[:1]
    for rid, shown in (("aborted", 5), ("aborted-n", 3)):
        out = finals[rid].outputs[0]
        assert out.finish_reason == "abort" and len(out.token_ids) == shown

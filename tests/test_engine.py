"""LLMEngine / LLM / AsyncEngine: golden greedy outputs through every scheduling regime, stops,
sampling, n > 1, logprobs, aborts that free every page, and no compiles after warmup."""

from __future__ import annotations

import asyncio
import contextlib
import time

import jax
import pytest
from jax import monitoring

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine import LLMEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.errors import ContextLengthExceeded, InvalidRequest
from jaxserve.entrypoints.llm import LLM
from jaxserve.core.sampling_params import SamplingParams
from tests.test_cli import tiny_gguf

SMOLLM2 = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compiles in this block, whatever triggers them (jit, eager ops)."""
    names = []

    def listener(name, secs, **kwargs):
        names.append(name)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lambda: names.count("/jax/core/compile/backend_compile_duration")
    finally:
        monitoring.unregister_event_duration_listener(listener)


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.scheduler.cache.check_invariants()
    stats = engine.stats()
    assert stats.pages_in_use == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.has_unfinished()


def filler_prompts(n: int) -> list[dict]:
    """Prompts of varied lengths (6..120 tokens) that share no page with the golden ones."""
    return [{"prompt_token_ids": [1000 + (7 * i + j) % 3000 for j in range(6 + (17 * i) % 115)]}
            for i in range(n)]


# ---------------------------------------------------------------- real SmolLM2 vs HF golden


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    return LLM(SMOLLM2, num_pages=512, max_num_seqs=32, max_num_batched_tokens=256,
               max_model_len=512, strict_compile=True, progress=False)


def golden_prompts(golden) -> list[dict]:
    return [{"prompt_token_ids": c["input_ids"]} for c in golden["cases"]]


def assert_golden(outs, golden) -> None:
    for out, case in zip(outs, golden["cases"]):
        comp = out.outputs[0]
        assert comp.token_ids == case["greedy_ids"], case["case"]
        assert comp.finish_reason == ("stop" if len(case["greedy_ids"]) < 32 else "length")
        assert comp.text == case["greedy_text"].replace("<|im_end|>", "")


@pytest.mark.slow
def test_golden_alone_mixed_and_prefix_cached(smollm2_llm, smollm2_golden):
    llm, engine = smollm2_llm, smollm2_llm.engine
    with count_compiles() as compiles:
        # (a) each case alone
        for prompt, case in zip(golden_prompts(smollm2_golden), smollm2_golden["cases"]):
            assert_golden(llm.generate(prompt, GREEDY), {"cases": [case]})
        # (b) all cases mixed with 20 other requests of other lengths and settings
        others = filler_prompts(20)
        params = [GREEDY] * 6 + [SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 3 * i,
                                                ignore_eos=True) for i in range(20)]
        outs = llm.generate(golden_prompts(smollm2_golden) + others, params)
        assert_golden(outs[:6], smollm2_golden)
        assert [len(o.outputs[0].token_ids) for o in outs[6:]] == [8 + 3 * i for i in range(20)]
        # (d) the same prompts twice in one call: the second copies hit the prefix cache
        hits = engine.stats().prefix_cache_hits
        outs = llm.generate(golden_prompts(smollm2_golden) * 2, GREEDY)
        assert_golden(outs[:6], smollm2_golden)
        assert_golden(outs[6:], smollm2_golden)
        assert engine.stats().prefix_cache_hits > hits
        assert engine.runner.num_serving_compiles == 0
        assert compiles() == 0  # nothing compiled after warmup, not even an eager op
    assert_no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [dict(quantization="int8"),
                                    dict(quantization="none"),
                                    dict(quantization="none", kv_cache_dtype="bfloat16"),
                                    dict(quantization="int8", kv_cache_dtype="bfloat16")],
                         ids=["int8-weights", "f32-load", "f32-weights-bf16-kv-cache", "both"])
def test_golden_with_int8_weights_or_a_bf16_kv_cache(smollm2_golden, engine):
    # int8: the GGUF's Q4_1 blocks land on int8 codes exactly (jaxserve.weights.quantize), from a
    # quarter of the layers' f32 weight bytes. none: the blocks dequantized to f32 at load (the
    # default here reads them in place: the other golden tests' subject). bf16 KV cache: K and V
    # rounded to bf16, attention still in f32. Each way the golden tokens stay equal; with a bf16
    # cache up to a near tie (`assert_golden_up_to_a_near_tie`). Steps of at least 8 tokens: the
    # smaller buckets' programs are test_golden_alone_mixed_and_prefix_cached's subject, and each
    # bucket below 8 is one more forward, and one more row count of samplers, to compile.
    llm = LLM(SMOLLM2, **engine, num_pages=64, max_num_seqs=8, max_num_batched_tokens=256,
              max_model_len=512, min_token_bucket=8, strict_compile=True, progress=False)
    assert llm.engine.config.model.quantization == {"none": None}.get(engine["quantization"],
                                                                      engine["quantization"])
    assert llm.engine.runner.kv_cache.dtype == engine.get("kv_cache_dtype", "float32")
    if "kv_cache_dtype" in engine:
        outs = llm.generate(golden_prompts(smollm2_golden), GREEDY.replace(logprobs=2))
        assert_golden_up_to_a_near_tie(outs, smollm2_golden)
    else:
        assert_golden(llm.generate(golden_prompts(smollm2_golden), GREEDY), smollm2_golden)
    assert llm.engine.runner.num_serving_compiles == 0
    assert_no_leaks(llm.engine)


# A bf16 KV cache moves the logprobs by ~1e-2 (SmolLM2's golden prompts), so a greedy token may
# flip where HF's top two are closer than that: "Once upon a time..." at its 6th token, 0.0045
# apart in f32, flips on some hosts (Intel Emerald Rapids) and not on others (AMD EPYC), by the
# f32 sums' order each host's XLA picks.
BF16_CACHE_TIE = 0.02


def assert_golden_up_to_a_near_tie(outs, golden) -> None:
    """Each case's golden tokens, or the golden prefix and then, at the first token that differs,
    a near tie: the golden token the runner-up, within BF16_CACHE_TIE of the token taken."""
    for out, case in zip(outs, golden["cases"]):
        got, want = out.outputs[0].token_ids, case["greedy_ids"]
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is None:
            assert_golden([out], {"cases": [case]})
            continue
        (first, lp_first), (second, lp_second) = out.outputs[0].logprobs[i].top[:2]
        assert (first, second) == (got[i], want[i]), (case["case"], i)
        assert lp_first - lp_second < BF16_CACHE_TIE, (case["case"], i, lp_first - lp_second)


@pytest.mark.slow
def test_golden_chunked_prefill_and_preemption(smollm2_golden):
    # (c) 16 tokens per step: every golden prompt but the shortest is split across steps.
    # (e) 8 usable pages of 16 tokens cannot hold the 6 cases at once: requests get preempted
    # and recomputed.
    llm = LLM(SMOLLM2, num_pages=9, max_num_seqs=8, max_num_batched_tokens=16,
              max_model_len=512, strict_compile=True, progress=False)
    outs = llm.generate(golden_prompts(smollm2_golden), GREEDY)
    assert_golden(outs, smollm2_golden)
    assert llm.engine.stats().num_preemptions > 0
    outs = llm.generate(golden_prompts(smollm2_golden) + filler_prompts(4),
                        [GREEDY] * 6 + [SamplingParams(max_tokens=20, ignore_eos=True)] * 4)
    assert_golden(outs[:6], smollm2_golden)
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_stop_strings_and_tokens(smollm2_llm, smollm2_golden):
    llm = smollm2_llm
    fox = {"prompt_token_ids": smollm2_golden["cases"][2]["input_ids"]}
    full = smollm2_golden["cases"][2]["greedy_text"]  # ' with a quick brown bear.\n\nThe ...'
    out = llm.generate(fox, GREEDY.replace(stop=["brown", "zzz"]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" with a quick ", "stop", "brown")
    out = llm.generate(fox, GREEDY.replace(stop=["brown"], include_stop_str_in_output=True))
    assert out[0].outputs[0].text == " with a quick brown"
    # A stop string spanning tokens: "bear.\n" ends inside the token after "bear".
    out = llm.generate(fox, GREEDY.replace(stop=[".\n\nThe"]))[0].outputs[0]
    assert out.text == full[:full.index(".\n\nThe")]
    # stop_token_ids: the stop token counts as generated but its text is not returned.
    ids = smollm2_golden["cases"][2]["greedy_ids"]
    out = llm.generate(fox, GREEDY.replace(stop_token_ids=[ids[3]]))[0].outputs[0]
    assert out.token_ids == ids[:4] and out.stop_reason == ids[3] and out.finish_reason == "stop"
    assert out.text == llm.get_tokenizer().decode(ids[:3])


@pytest.mark.slow
def test_min_tokens_ignore_eos_and_max_tokens(smollm2_llm, smollm2_golden):
    llm = smollm2_llm
    paris = {"prompt_token_ids": smollm2_golden["cases"][0]["input_ids"]}  # EOS after 8 tokens
    out = llm.generate(paris, GREEDY.replace(min_tokens=12, max_tokens=12))[0].outputs[0]
    assert len(out.token_ids) == 12 and 2 not in out.token_ids and out.finish_reason == "length"
    out = llm.generate(paris, GREEDY.replace(ignore_eos=True, max_tokens=10))[0].outputs[0]
    assert out.token_ids[7] == 2 and len(out.token_ids) == 10
    out = llm.generate(paris, GREEDY.replace(max_tokens=3))[0].outputs[0]
    assert out.token_ids == smollm2_golden["cases"][0]["greedy_ids"][:3]
    assert out.finish_reason == "length" and out.text == "The capital of"


@pytest.mark.slow
def test_seeded_sampling_n_and_logprobs(smollm2_llm, smollm2_golden):
    llm = smollm2_llm
    prompt = {"prompt_token_ids": smollm2_golden["cases"][4]["input_ids"]}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt, params)[0].outputs[0].token_ids
    mixed = llm.generate([prompt] + filler_prompts(5), params)[0].outputs[0].token_ids
    assert alone == mixed  # same seed, same tokens, whatever shares the batch
    outs = llm.generate(prompt, params.replace(n=3, logprobs=5))[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert outs[0].token_ids == alone  # sequence i uses seed + i
    assert len({tuple(o.token_ids) for o in outs}) == 3
    # The n sequences of a new 40-token prompt compute its 2 full pages once.
    hits = llm.engine.stats().prefix_cache_hits
    llm.generate({"prompt_token_ids": list(range(3000, 3040))}, params.replace(n=3))
    assert llm.engine.stats().prefix_cache_hits - hits == 2 * 32
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids)
        for lp in o.logprobs:
            assert len(lp.top) == 5 and lp.logprob <= lp.top[0][1] + 1e-5
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    greedy = llm.generate(prompt, GREEDY.replace(logprobs=2, max_tokens=4))[0].outputs[0]
    for tok, lp in zip(greedy.token_ids, greedy.logprobs):
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-5


@pytest.mark.slow
def test_async_engine_streams_and_abort_frees_pages(smollm2_llm, smollm2_golden):
    engine = AsyncEngine(smollm2_llm.engine)
    case = smollm2_golden["cases"][4]

    async def main():
        texts, ids = [], []
        async for out in engine.generate({"prompt_token_ids": case["input_ids"]}, GREEDY, "a"):
            texts.append(out.outputs[0].text)
            ids = out.outputs[0].token_ids
        assert ids == case["greedy_ids"] and texts[-1] == case["greedy_text"]
        assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
        # Leaving a stream early aborts its request; an explicit abort ends the other.
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        gen = engine.generate({"prompt_token_ids": case["input_ids"]}, long, "b")
        other = engine.generate({"prompt_token_ids": case["input_ids"]}, long, "c")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()
        first = await other.__anext__()
        await engine.abort("c")
        async for last in other:
            pass
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert len(last.outputs[0].token_ids) < 400 and first.request_id == "c"
        with pytest.raises(ContextLengthExceeded):
            async for _ in engine.generate({"prompt_token_ids": [5] * 600}, GREEDY):
                pass
        for _ in range(100):  # the abort of "b" lands on the engine thread
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert_no_leaks(smollm2_llm.engine)


# ---------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_tokenizer_fields):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)


# The tiny engines' tests are about aborts, failures, queues and deadlines, not small steps (the
# SmolLM2 engines above compile every bucket from 1 token): steps of at least 16 tokens, 2 forwards
# and one row count of samplers to compile instead of 6 and up to 3 (conftest.py).
TINY_ENGINE = dict(num_pages=40, max_num_batched_tokens=32, max_model_len=128,
                   min_token_bucket=16, strict_compile=True, progress=False)


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    """One engine (compiled once) for the abort and failure tests: each leaves it empty, which
    assert_no_leaks checks."""
    engine = build_engine(str(tiny_path), max_num_seqs=4, **TINY_ENGINE)
    yield engine
    engine.close()


def test_abort_mid_generation_frees_pages(tiny_engine):
    engine = tiny_engine
    long = SamplingParams(max_tokens=80, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(10, 40 + 7 * i))}, long)
    for _ in range(4):
        engine.step()
    assert engine.stats().pages_in_use > 0
    assert engine.abort("r1") and not engine.abort("r1") and not engine.abort("nope")
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals  # exactly one terminal output each
                finals[out.request_id] = out
            if out.request_id == "r2" and len(out.outputs[0].token_ids) == 5:
                engine.abort("r2")
    assert finals["r1"].outputs[0].finish_reason == "abort"
    assert finals["r2"].outputs[0].finish_reason == "abort"
    assert len(finals["r2"].outputs[0].token_ids) == 5
    assert finals["r0"].outputs[0].finish_reason == "length"
    assert len(finals["r0"].outputs[0].token_ids) == 80
    assert_no_leaks(engine)


def test_abort_one_sequence_of_n_frees_its_pages_and_its_siblings_go_on(tiny_engine):
    engine = tiny_engine
    params = SamplingParams(n=3, max_tokens=40, ignore_eos=True, seed=1)
    engine.add_request("r", {"prompt_token_ids": list(range(10, 50))}, params)
    for _ in range(4):
        engine.step()
    held = engine.stats().pages_in_use
    assert engine.abort_sequence("r", 1)
    assert not engine.abort_sequence("r", 1) and not engine.abort_sequence("r", 3)
    assert not engine.abort_sequence("nope", 0)
    assert engine.stats().pages_in_use < held  # at once, not when its siblings end
    finals = []
    while engine.has_unfinished():
        finals += [out for out in engine.step() if out.finished]
    [final] = finals
    reasons = [(c.finish_reason, len(c.token_ids)) for c in final.outputs]
    assert reasons[0] == reasons[2] == ("length", 40)
    assert reasons[1][0] == "abort" and reasons[1][1] < 40
    # Ending the last running sequence ends the request: one final output, nothing leaked.
    engine.add_request("s", {"prompt_token_ids": list(range(10, 20))},
                       SamplingParams(n=2, max_tokens=40, ignore_eos=True))
    engine.step()
    assert engine.abort_sequence("s", 0) and engine.abort_sequence("s", 1)
    [out] = engine.step()
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert_no_leaks(engine)


def test_bf16_kv_cache_through_the_cpu_kernel_library(tmp_path, smollm2_tokenizer_fields,
                                                      monkeypatch):
    # kv_cache_dtype="bfloat16" on CPU: decodes, KV writes and prefill chunks' page gathers go
    # through the CPU kernels' attention.cc (XLA:CPU widens the whole cache to f32 around a bf16
    # scatter or gather); head_dim 64, a shape the attention kernel takes. Chunked prefills beside
    # decodes; the tokens are those of the pure-XLA path (the CPU kernels switched off).
    from jaxserve.entrypoints.cli import build_parser
    from jaxserve.entrypoints.engine_flags import engine_args
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.kernels.attention import cpu

    path = tiny_gguf(tmp_path / "tiny64.gguf", smollm2_tokenizer_fields, hidden_size=128,
                     num_heads=2, num_kv_heads=1, head_dim=64)
    flags = engine_args(build_parser().parse_args(
        ["serve", "--model", str(path), "--kv-cache-dtype", "bfloat16", "--num-pages", "40",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128"]))
    assert flags["kv_cache_dtype"] == "bfloat16"
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 9 * i))} for i in range(4)]

    def run():
        jax.clear_caches()  # the forward is traced again, with or without the library
        llm = LLM(str(path), **flags, warmup=False, progress=False)
        runner = llm.engine.runner
        assert runner.kv_cache.dtype == "bfloat16"
        program = runner._forward_jit.lower(runner.params, runner.kv_cache,
                                            runner._plan_spec(32), runner._last_tokens).as_text()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], program

    assert cpu_kernels.enabled()
    with_library, program = run()
    assert all(target in program for target in cpu.TARGETS)
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    without, program = run()
    assert not any(target in program for target in cpu.TARGETS)
    assert without == with_library
    jax.clear_caches()


def test_request_validation(tiny_path):
    llm = LLM(str(tiny_path), num_pages=8, max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=128, warmup=False, progress=False)
    engine = llm.engine
    with pytest.raises(ContextLengthExceeded, match="max_model_len is 128"):
        engine.prepare("x", {"prompt_token_ids": [3] * 129})
    with pytest.raises(ContextLengthExceeded, match="needs 8 KV pages but the pool has 7"):
        engine.prepare("x", [3] * 100, SamplingParams(max_tokens=40))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.prepare("x", [3, 49152])
    with pytest.raises(InvalidRequest, match="at least one token"):
        engine.prepare("x", [])
    with pytest.raises(InvalidRequest, match="2 sampling params for 1 prompts"):
        llm.generate(["hi"], [SamplingParams(), SamplingParams()])
    # max_tokens left out: up to the context (128) or what the pool holds (7 pages: 112 tokens)
    assert engine.prepare("x", [3] * 100, SamplingParams(max_tokens=None)).params.max_tokens == 12
    engine.add_request("dup", "hello")
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("dup", "hello")
    engine.abort("dup")
    engine.step()
    assert_no_leaks(engine)


def test_one_failing_request_ends_alone(tiny_engine, monkeypatch):
    """A request whose host-side processing raises ends with an error and frees its pages; the
    others in the same batches finish; through AsyncEngine the failure is that stream's error."""
    from jaxserve.errors import RequestFailed

    engine = tiny_engine
    on_token = engine.output_processor._on_token

    def failing(group, seq, token, *args):
        if group.prepared.request_id == "bad" and len(seq.request.output_token_ids) == 3:
            raise RuntimeError("detokenizer exploded")
        return on_token(group, seq, token, *args)

    monkeypatch.setattr(engine.output_processor, "_on_token", failing)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM.from_engine(engine)
    outs = llm.generate([[5, 6, 7]] * 3, params)  # unaffected
    assert all(len(o.outputs[0].token_ids) == 10 and o.error is None for o in outs)
    async_engine = AsyncEngine(engine)

    async def run(request_id):
        async for out in async_engine.generate([5, 6, 7], params.replace(n=2), request_id):
            last = out
        return last

    async def main():
        return await asyncio.gather(run("ok"), run("bad"), run("ok2"), return_exceptions=True)

    try:
        ok, bad, ok2 = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert isinstance(bad, RequestFailed) and "detokenizer exploded" in str(bad)
    for out in (ok, ok2):
        assert [len(c.token_ids) for c in out.outputs] == [10, 10]
    assert_no_leaks(engine)


def test_num_queued_counts_sequences_not_yet_running(tiny_path):
    """num_queued (what a server's admission limit reads) counts each sequence of an n > 1
    request, from submission on, and drops as requests leave."""
    engine = build_engine(str(tiny_path), max_num_seqs=1, **TINY_ENGINE)
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=120, ignore_eos=True)

    async def main():
        running = async_engine.generate([5, 6, 7], params, "running")
        await running.__anext__()  # it holds the only slot until its 120 tokens are done
        counts = [async_engine.num_queued]
        waiting = async_engine.generate([5, 6], params.replace(n=2), "waiting")
        task = asyncio.ensure_future(waiting.__anext__())
        await _until(lambda: async_engine.num_queued >= 2)
        counts.append(async_engine.num_queued)
        task.cancel()  # leaving a stream aborts its request
        await asyncio.gather(task, return_exceptions=True)
        await running.aclose()
        await _until(lambda: async_engine.num_queued == 0)
        return counts

    try:
        counts = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert counts == [0, 2]
    assert_no_leaks(engine)


async def _until(predicate, timeout_s: float = 30.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout_s)


def test_deadlines_queue_timeouts_and_shedding_end_whole_requests(tiny_path):
    """Each outcome ends every sequence of its request at once, with its own finish reason, and
    frees the pages; through AsyncEngine each is a typed error, and a full queue sheds a
    less important never-started request instead of refusing a more important one."""
    from jaxserve.errors import DeadlineExceeded, EngineOverloaded, QueueTimeout
    from jaxserve.core.request import QoS, ServiceClass

    engine = build_engine(str(tiny_path), max_num_seqs=2, **TINY_ENGINE)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    batch = QoS(priority=ServiceClass.BATCH)
    engine.add_request("run", [5, 6, 7], long, qos=QoS(deadline=3.0))
    # One of its sequences starts at once: the other, still waiting at t = 2, is not timed out.
    engine.add_request("started", [5, 7], long.replace(n=2), qos=QoS(queue_deadline=1.5))
    engine.add_request("queued", [5, 6], long.replace(n=2), qos=QoS(queue_deadline=2.0))
    engine.add_request("batch", [8, 9], long, qos=batch)
    engine.add_request("batch2", [8, 9, 10], long, qos=batch)
    finals = {}

    def step():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        now[0] += 1

    step()  # t = 0: "run" and one of "started" take the two seats
    assert engine.shed(ServiceClass.BATCH, 1) == []  # nothing less important than batch
    assert engine.shed(ServiceClass.STANDARD, 1) == ["batch2"]  # the newest batch request
    for _ in range(4):  # t = 1: batch2's final; t = 2: "queued" times out; t = 3: "run" expires
        step()
    while engine.has_unfinished():
        step()
    reasons = {rid: [(c.finish_reason, len(c.token_ids)) for c in out.outputs]
               for rid, out in finals.items()}
    # "run" shows the 2 tokens counted before it expired: the token of the step in flight then
    # is dropped, as an abort's is (usage and generation_tokens agree, issue 39).
    assert reasons == {"batch2": [("shed", 0)], "queued": [("queue_timeout", 0)] * 2,
                       "run": [("deadline", 2)], "started": [("length", 50)] * 2,
                       "batch": [("length", 50)]}
    assert engine.stats().generation_tokens == 2 + 2 * 50 + 50
    assert_no_leaks(engine)

    engine.scheduler.clock = time.monotonic
    # Steps of at least 10 ms, so "hold" (120 tokens) keeps both seats past the 0.2 s deadlines
    # below on any host: the tiny model's own step takes ~1 ms on a fast one.
    step_alone = engine.step
    engine.step = lambda: (time.sleep(0.01), step_alone())[1]
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def last(stream):
        async for out in stream:
            pass
        return out

    async def main():
        hold = async_engine.generate(
            [5, 6, 7], SamplingParams(max_tokens=120, ignore_eos=True, n=2), "hold")
        await hold.__anext__()  # it holds both seats
        low = asyncio.ensure_future(last(async_engine.generate([5, 6], params, "low", qos=batch)))
        await _until(lambda: async_engine.stats().num_new_by_priority == {ServiceClass.BATCH: 1})
        with pytest.raises(EngineOverloaded):  # a batch request cannot displace another
            async_engine.admit(1, max_queued=1, priority=ServiceClass.BATCH)
        async_engine.admit(1, max_queued=1, priority=ServiceClass.STANDARD)  # displaces "low"
        with pytest.raises(EngineOverloaded, match="shed") as shed:
            await low
        assert shed.value.retry_after > 0
        late = last(async_engine.generate([5, 6], params, "late",
                                          qos=QoS(deadline=time.monotonic() + 0.2)))
        timeout = last(async_engine.generate(
            [5, 6], params, "timeout", qos=QoS(queue_deadline=time.monotonic() + 0.2)))
        results = await asyncio.gather(late, timeout, return_exceptions=True)
        await hold.aclose()
        await _until(lambda: async_engine.stats().num_running == 0)
        return results

    try:
        late, timeout = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert isinstance(late, DeadlineExceeded) and isinstance(timeout, QueueTimeout)
    assert_no_leaks(engine)

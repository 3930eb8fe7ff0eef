"""Small decode steps: what the token buckets below 16 buy (step time) and cost (warmup).

For SmolLM2 (default) two engines in one process, `min_token_bucket=16` (every step padded to at
least 16 tokens, as before) and `min_token_bucket=1`, report:
- the decode step of n = 1, 2, 4, 8, 16 sequences (contexts of 46-286 tokens, forward + sampler,
  through the engine's warmed programs) at the n-token bucket and at the 16-token bucket, greedy
  and sampled (temperature 0.8, top-p 0.95), alternating the two, best of `--repeats`;
- each program's compile seconds at warmup: the forward per token bucket, the sampler variants
  and the bitmask step per logits-row bucket;
- end to end: one request's decode ms/token through `LLM.generate` on each engine
  ((time of 1 + N tokens - time of 1 token) / N, alternating, best of `--repeats`).
`--model tiny` reports only the compile seconds, for the tests' tiny random model at the tests'
engine shape (max_num_seqs 4, max_num_batched_tokens 32): what each extra bucket adds to every
engine the test suite starts.

    python benchmarks/decode_buckets.py [--model tiny] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from throughput import SMOLLM2, decode_plan  # benchmarks/ is the script's directory

SIZES = (1, 2, 4, 8, 16)


def compile_table(runner) -> dict:
    """Compile seconds: the forward per token bucket; the samplers and bitmask per row bucket."""
    forward, rows = {}, defaultdict(float)
    for key, secs in runner.program_compile_seconds.items():
        if key[0] == "forward":
            forward[key[1]] = round(secs, 2)
        else:
            rows[key[1]] = round(rows[key[1]] + secs, 2)
    return {"forward_by_token_bucket": forward, "sampler_and_bitmask_by_row_bucket": dict(rows)}


def step_ms(runner, plan, rows) -> float:
    t0 = time.perf_counter()
    runner.sample(runner.forward(plan), rows)  # returns host arrays: the step is done
    return (time.perf_counter() - t0) * 1e3


def step_table(runner, repeats: int) -> list[dict]:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.executor.sampling_rows import SamplingRow

    kinds = {"greedy": SamplingParams(temperature=0, max_tokens=None),
             "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=None)}
    out = []
    for n in SIZES:
        own, padded = decode_plan(runner.shapes, n)[0], decode_plan(runner.shapes, n, 16)[0]
        for kind, params in kinds.items():
            rows = [SamplingRow(params, 0, [1], [])] * n
            best = {"own": float("inf"), "16": float("inf")}
            step_ms(runner, own, rows), step_ms(runner, padded, rows)  # first calls
            for _ in range(repeats):
                best["own"] = min(best["own"], step_ms(runner, own, rows))
                best["16"] = min(best["16"], step_ms(runner, padded, rows))
            out.append({"num_seqs": n, "sampling": kind, "bucket": len(own.token_ids),
                        "ms": round(best["own"], 1), "ms_at_16": round(best["16"], 1),
                        "speedup": round(best["16"] / best["own"], 2)})
            print(f"{n:2d} seqs {kind:7s}: bucket {len(own.token_ids):2d} {best['own']:6.1f} ms, "
                  f"bucket 16 {best['16']:6.1f} ms: {best['16'] / best['own']:.2f}x")
    return out


def decode_ms_per_token(llms: dict, repeats: int, new_tokens: int = 64) -> dict:
    from jaxserve import SamplingParams

    prompt = {"prompt_token_ids": [1 + (37 * i) % 4000 for i in range(100)]}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=1 + new_tokens, ignore_eos=True)
    best = dict.fromkeys(llms, float("inf"))
    for name, llm in llms.items():  # first calls
        llm.generate(prompt, one)
    for _ in range(repeats):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            llm.generate(prompt, one)
            t1 = time.perf_counter()
            llm.generate(prompt, many)
            t2 = time.perf_counter()
            best[name] = min(best[name], ((t2 - t1) - (t1 - t0)) / new_tokens * 1e3)
    return {name: round(ms, 1) for name, ms in best.items()}


def tiny_runner():
    """The tests' tiny random model (tests/test_weights.tiny with SmolLM2's vocabulary) at the
    engine shape most tests use."""
    import jax

    from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from jaxserve.executor.models import decoder
    from jaxserve.executor.runner import ModelRunner

    config = ModelConfig(name="tiny", vocab_size=49152, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         rms_norm_eps=2.0 ** -20, rope_theta=10000.0, max_position_embeddings=128,
                         bos_token_id=1, eos_token_ids=(2,))
    return ModelRunner(config, decoder.init_params(config, jax.random.key(0)),
                       CacheConfig(num_pages=40), SchedulerConfig(
                           max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128),
                       eos_token_ids=(2,))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2, help=f"a registered model, or 'tiny' ({SMOLLM2})")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.model == "tiny":
        runner = tiny_runner()
        runner.warmup(progress=False)
        result = {"compile_seconds": compile_table(runner)}
    else:
        from jaxserve import LLM

        llms = {}
        for min_bucket in (16, 1):
            t0 = time.perf_counter()
            llms[min_bucket] = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=512,
                                   max_model_len=512, min_token_bucket=min_bucket,
                                   strict_compile=True, progress=False)
            print(f"min_token_bucket={min_bucket}: ready in {time.perf_counter() - t0:.1f} s")
        result = {"steps": step_table(llms[1].engine.runner, args.repeats),
                  "decode_ms_per_token": decode_ms_per_token(llms, args.repeats),
                  "compile_seconds": compile_table(llms[1].engine.runner)}
        e2e = result["decode_ms_per_token"]
        print(f"one request, decode ms/token: min_token_bucket=16 {e2e[16]}, 1 {e2e[1]}: "
              f"{e2e[16] / e2e[1]:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

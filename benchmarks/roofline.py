"""The engine's step against the device's roofline: decode at batch 1 and 64, and prefill.

For each model, a ModelRunner (the engine's own compiled programs: forward over a ragged batch
plan, then the greedy sampler) times:
- decode: N one-token queries, each at --context tokens of context (N in --batches: 1 and 64);
- prefill: --prefill-seqs chunks of --prefill-tokens new tokens each, from position 0.
Two times per batch, each the best of --repeats: `step` is one synchronous engine step (plan to
the device, forward, sampler, tokens back to the host), as serving runs it; `queued` is the
forward alone, called back to back (the device's time, host work hidden behind it).

Roofline, with the copy bandwidth and matmul peak measured in the same run (benchmarks/kernels.py;
the matmul in the model's dtype): a step must read every weight once and each sequence's K/V in
every layer (bytes over the copy bandwidth), and do 2 x the matmul parameters x its tokens (the LM
head only for each sequence's last token) plus attention's 4 x Hq x D per (query, key) pair per
layer (FLOPs over the matmul peak). The larger of the two is its floor (decode is memory-bound on
a GPU, prefill compute-bound); "of roofline" is floor / measured time.

Models: `smollm2` (the registry's GGUF, when fetched) and `llama-1b` (random weights in
Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 query / 8 KV heads of 128, MLP 8192, vocabulary
128256, tied embeddings). Default dtype: bfloat16 on an accelerator, float32 on the CPU. Made for
accelerators: on a CPU the copy figure (one XLA elementwise op) understates what the matmuls
stream, so only the compute floor means much there.

    python benchmarks/roofline.py [--models smollm2,llama-1b] [--dtype bfloat16] [--context 1024]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from kernels import measure_peaks  # benchmarks/ is the script's directory
from throughput import SMOLLM2, greedy_step_seconds, step_flops, step_plan

LLAMA_1B = dict(name="llama-1b-random", vocab_size=128256, hidden_size=2048,
                intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=128,
                rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def load(name: str, dtype: str):
    import jax

    from jaxserve.config import ModelConfig

    if name == "smollm2":
        from jaxserve.model_registry import resolve
        from jaxserve.weights import load_model

        return load_model(resolve(SMOLLM2), dtype=dtype)
    if name == "llama-1b":
        from jaxserve.executor.models.decoder import init_params

        config = ModelConfig(**LLAMA_1B, dtype=dtype)
        return config, init_params(config, jax.random.key(0))
    raise SystemExit(f"unknown model {name!r}: expected smollm2 or llama-1b")


def make_runner(config, params, args, num_seqs: int, max_tokens: int):
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.executor.runner import ModelRunner
    from jaxserve.shapes import cdiv

    page = 16
    max_len = max(args.context + 1, args.prefill_tokens)
    pages = max(num_seqs, args.prefill_seqs) * cdiv(max_len, page) + 2
    return ModelRunner(config, params, CacheConfig(page_size=page, num_pages=pages),
                       SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max_tokens,
                                       max_model_len=max_len + page),
                       eos_token_ids=[0])


def time_plan(runner, plan, num_rows: int, repeats: int) -> tuple[float, float]:
    """(step, queued) seconds, each the best of `repeats` (after one compile-and-warm call)."""
    import jax

    step = greedy_step_seconds(runner, plan, num_rows, repeats)
    queued = float("inf")
    for _ in range(repeats):
        iters = 10
        jax.block_until_ready(runner.kv_cache)
        t0 = time.perf_counter()
        for _ in range(iters):
            logits = runner.forward(plan)
        jax.block_until_ready(logits)
        queued = min(queued, (time.perf_counter() - t0) / iters)
    return step, queued


def run_model(name: str, args, bw: float, peak: float) -> list[dict]:
    import jax

    from jaxserve.executor.runner import kv_page_bytes

    config, params = load(name, args.dtype)
    c = config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv_token_bytes = kv_page_bytes(c, 1, c.dtype)
    rng = np.random.default_rng(0)
    rows = []
    max_tokens = max(64, args.prefill_seqs * args.prefill_tokens)
    runner = make_runner(config, params, args, num_seqs=max(args.batches), max_tokens=max_tokens)

    def measure(batch: str, token_lists, starts):
        plan = step_plan(runner.shapes, token_lists, starts)
        step, queued = time_plan(runner, plan, len(token_lists), args.repeats)
        tokens = sum(len(t) for t in token_lists)
        # (query, key) pairs: query i of a chunk at position start + i sees start + i + 1 keys
        pairs = sum(len(t) * (s + 1) + len(t) * (len(t) - 1) // 2
                    for t, s in zip(token_lists, starts))
        flops = step_flops(c, tokens, len(token_lists), pairs)
        kv_tokens = sum(s + len(t) for t, s in zip(token_lists, starts))
        nbytes = weight_bytes + kv_tokens * kv_token_bytes
        floor = max(flops / peak, nbytes / bw)
        rows.append(dict(model=name, batch=batch, tokens=tokens, step_ms=step * 1e3,
                         queued_ms=queued * 1e3, floor_ms=floor * 1e3,
                         bound="compute" if flops / peak >= nbytes / bw else "memory"))

    for n in args.batches:
        measure(f"decode {n} x {args.context} ctx",
                [[int(t)] for t in rng.integers(1, c.vocab_size, n)], [args.context] * n)
    S, P = args.prefill_seqs, args.prefill_tokens
    measure(f"prefill {S} x {P}",
            [[int(t) for t in rng.integers(1, c.vocab_size, P)] for _ in range(S)], [0] * S)
    runner.close()
    del params
    jax.clear_caches()
    for r in rows:
        r.update(dtype=args.dtype, weight_gb=weight_bytes / 1e9,
                 step_tok_s=r["tokens"] / r["step_ms"] * 1e3,
                 queued_tok_s=r["tokens"] / r["queued_ms"] * 1e3,
                 step_of_roofline=r["floor_ms"] / r["step_ms"],
                 queued_of_roofline=r["floor_ms"] / r["queued_ms"])
    return rows


def main() -> None:
    import jax

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,llama-1b")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on an accelerator, else float32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")], default=[1, 64],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args()
    on_accel = jax.default_backend() != "cpu"
    args.dtype = args.dtype or ("bfloat16" if on_accel else "float32")
    bw, peak = measure_peaks(on_accel, dtype=args.dtype)
    device = jax.devices()[0].device_kind
    print(f"device: {device}; JAX {jax.__version__}; measured copy {bw / 1e9:.0f} GB/s, "
          f"{args.dtype} matmul {peak / 1e12:.1f} TFLOP/s")
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args, bw, peak)
    print("| model | batch | step ms | step tok/s | of roofline | queued ms | queued tok/s "
          "| of roofline | floor ms (bound) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} {r['dtype']} ({r['weight_gb']:.2f} GB) | {r['batch']} | "
              f"{r['step_ms']:.2f} | {r['step_tok_s']:.0f} | {r['step_of_roofline']:.0%} | "
              f"{r['queued_ms']:.2f} | {r['queued_tok_s']:.0f} | {r['queued_of_roofline']:.0%} | "
              f"{r['floor_ms']:.3f} ({r['bound']}) |")
    result = {"device": device, "jax": jax.__version__, "copy_gb_s": bw / 1e9,
              "matmul_tflop_s": peak / 1e12, "rows": rows}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

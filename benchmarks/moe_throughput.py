"""Mixture of experts: offline throughput against HF transformers, and the MoE step against a dense
model of the same active parameters, in one run (issue 36).

The subject is a random-weight model shaped like Qwen3-30B-A3B scaled down to this machine: the
same 128 experts and top-8 (norm_topk_prob), Qwen3's q/k norms, narrower and shallower (hidden
512, 4 layers, 8 query / 2 KV heads of 64, experts of width 192: the 2048 : 768 ratio of the
original), SmolLM2's vocabulary and tokenizer; built by transformers' own Qwen3MoeForCausalLM
(fixed seed) and saved with save_pretrained. The dense twin is Qwen3ForCausalLM with the same
attention and an MLP of width 8 x 192 = 1536, so a token meets the same number of matmul weights
(the active parameters) in both; its weights are random too.

1. Offline throughput (benchmarks/throughput.py's workload and drivers): jaxserve's LLM against
   HF transformers' static-batch generate on the same MoE checkpoint. Target >= 3x.
2. Step time: the engine's decode step (64 one-token sequences) and a 256-token prefill step, MoE
   over dense, through the compiled programs serving runs. Target <= 1.5x. The MoE runs twice:
   with the experts through the CPU grouped-matmul kernel (what serving runs where the CPU
   kernels do) and through the pure-JAX loop over tiles (`--moe-paths tiles`: the path before the
   kernel, and the one with JAXSERVE_CPU_KERNELS=off). The three engines are built first, then
   timed in alternating rounds (best of all rounds), so the machine's load falls alike on each.
   Two decodes: every sequence's token the same (token 1, what earlier records measured: the 64
   rows route alike, to about top-k experts) and 64 distinct random tokens (rows spread over the
   experts, as in serving: about 126 of 128 experts hit per layer).
   `--bf16`: also both models as released, their weights stored in bf16 (a copy of each
   checkpoint rounded to bf16), which the CPU kernels read as bf16 (ModelConfig.weight_dtype),
   timed in the same rounds.

    python benchmarks/moe_throughput.py [--num-requests 16] [--out DIR] [--steps-only] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from throughput import decode_plan, greedy_step_seconds, run_hf, run_jaxserve, step_plan
from workload import pydoc_workload

SHAPE = dict(vocab_size=49152, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
EXPERTS, TOP_K, EXPERT_WIDTH = 128, 8, 192


def build(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """The MoE checkpoint and its dense twin of equal active parameters, under `out`."""
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.model_registry import fetch

    gguf = fetch("smollm2-135m-instruct", quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    configs = {
        "moe": tf.Qwen3MoeConfig(**SHAPE, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                 moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True,
                                 intermediate_size=TOP_K * EXPERT_WIDTH, decoder_sparse_step=1,
                                 mlp_only_layers=[]),
        "dense": tf.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH),
    }
    paths = []
    for name, config in configs.items():
        path = out / name
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if name == "moe":  # HF starts the routers at 0: every token would tie
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if n.endswith("mlp.gate.weight"):
                            p.normal_(0.0, 0.02)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def bf16_copy(path: Path) -> Path:
    """`path`'s checkpoint with every tensor rounded to bf16 and stored so, as released models
    are (beside it, made once)."""
    import ml_dtypes
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = path.with_name(path.name + "_bf16")
    if not (out / "model.safetensors").exists():
        out.mkdir(exist_ok=True)
        for f in path.iterdir():
            if f.suffix != ".safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        with safe_open(str(path / "model.safetensors"), framework="np") as st:
            tensors = {k: st.get_tensor(k).astype(ml_dtypes.bfloat16) for k in st.keys()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


STEPS = ("decode_64_ms", "decode_64_distinct_ms", "prefill_256_ms")


def experts_path(path: str):
    """The MoE's CPU path while an engine is built: `kernel` (what serving picks) or `tiles`."""
    from jaxserve.executor.models import moe

    if path == "kernel":
        return contextlib.nullcontext()
    return mock.patch.object(moe, "experts_in_place", lambda config, mesh: False)


def step_engine(model: Path, path: str = "kernel"):
    """An engine's runner and its three step plans (STEPS), compiled."""
    from jaxserve import LLM

    with experts_path(path):
        llm = LLM(str(model), max_num_seqs=64, max_num_batched_tokens=256, max_model_len=512,
                  progress=False)
    runner = llm.engine.runner
    same, kv_lens = decode_plan(runner.shapes, 64)
    tokens = np.random.default_rng(1).integers(3, 49152, 64)
    distinct = step_plan(runner.shapes, [[int(t)] for t in tokens], [int(n) - 1 for n in kv_lens])
    prefill = step_plan(runner.shapes, [list(range(3, 259))], [0])
    return runner, {"decode_64_ms": (same, 64), "decode_64_distinct_ms": (distinct, 64),
                    "prefill_256_ms": (prefill, 1)}


def step_times(engines: dict, rounds: int) -> dict:
    """Each engine's steps, best of 3 per round over alternating rounds: name -> step -> ms."""
    best = {name: dict.fromkeys(STEPS, float("inf")) for name in engines}
    for _ in range(rounds):
        for name, (runner, plans) in engines.items():
            for step, (plan, rows) in plans.items():
                ms = greedy_step_seconds(runner, plan, rows, 3) * 1e3
                best[name][step] = min(best[name][step], ms)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jaxserve-moe-bench")
    p.add_argument("--steps-only", action="store_true", help="only the step phase")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of the step phase")
    p.add_argument("--bf16", action="store_true",
                   help="also time both models with their weights stored in bf16")
    args = p.parse_args()
    args.decode_step = False

    moe, dense = build(args.out)
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    args.model = str(moe)
    work = pydoc_workload(load_tokenizer(resolve(args.model)), args.num_requests, seed=0,
                          prompt_tokens=(16, 256), output_tokens=(16, 192))
    output_tokens = sum(n for _, n in work)
    load = os.getloadavg()
    t0 = time.perf_counter()
    results, steps = {}, {}
    # Each phase prints as it ends (a loaded machine may not let the run finish).
    for name, run in () if args.steps_only else (("jaxserve", run_jaxserve), ("hf", run_hf)):
        results[name] = run(work, args)
        results[name]["output_tok_s"] = output_tokens / results[name]["seconds"]
        print(name, json.dumps(results[name]), flush=True)
    engines = {"moe": step_engine(moe), "moe_tiles": step_engine(moe, "tiles"),
               "dense": step_engine(dense)}
    if args.bf16:
        engines.update(moe_bf16=step_engine(bf16_copy(moe)),
                       dense_bf16=step_engine(bf16_copy(dense)))
        for name in ("moe_bf16", "dense_bf16"):  # read as bf16, not widened at load
            assert engines[name][0].config.weight_dtype == "bfloat16", name
    steps = step_times(engines, args.rounds)
    print(json.dumps(steps), flush=True)
    load_after = os.getloadavg()
    print(f"model: Qwen3-MoE scaled, {EXPERTS} experts top-{TOP_K}, hidden "
          f"{SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers; dense twin MLP "
          f"{TOP_K * EXPERT_WIDTH}; {platform.machine()}, {os.cpu_count()} CPUs; load average "
          f"{load[0]:.1f} before, {load_after[0]:.1f} after ({time.perf_counter() - t0:.0f} s)")
    print(f"workload: {len(work)} requests, {output_tokens} output tokens")
    for name, r in results.items():
        print(f"{name:9s} {r['seconds']:7.1f} s  output {r['output_tok_s']:7.1f} tok/s")
    if results:
        ratio = results["jaxserve"]["output_tok_s"] / results["hf"]["output_tok_s"]
        print(f"jaxserve / HF transformers on the MoE (static batch {args.hf_batch_size}): "
              f"{ratio:.2f}x (target >= 3x)")
    for key in STEPS:
        m, t, d = steps["moe"][key], steps["moe_tiles"][key], steps["dense"][key]
        print(f"{key}: MoE {m:.1f} ms (tiles {t:.1f} ms), dense of equal active parameters "
              f"{d:.1f} ms: {m / d:.2f}x (tiles {t / d:.2f}x; target <= 1.5x)")
        if args.bf16:
            mb, db = steps["moe_bf16"][key], steps["dense_bf16"][key]
            print(f"  bf16 weights: MoE {mb:.1f} ms, dense {db:.1f} ms: {mb / db:.2f}x "
                  f"(f32 -> bf16: MoE {m / mb:.2f}x, dense {d / db:.2f}x faster)")
    print(json.dumps({"results": results, "steps": steps, "load": [load, load_after]}))


if __name__ == "__main__":
    main()

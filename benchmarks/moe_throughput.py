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
   over dense, through the compiled programs serving runs. Target <= 1.5x.

    python benchmarks/moe_throughput.py [--num-requests 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

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


def step_times(model: Path, args) -> dict:
    """The decode step of 64 sequences and a 256-token prefill step, best of 5 each."""
    from jaxserve import LLM

    llm = LLM(str(model), max_num_seqs=64, max_num_batched_tokens=256, max_model_len=512,
              progress=False)
    runner = llm.engine.runner
    plan, _ = decode_plan(runner.shapes, 64)
    decode = greedy_step_seconds(runner, plan, 64, 5)
    prefill = step_plan(runner.shapes, [list(range(3, 259))], [0])
    prefill_s = greedy_step_seconds(runner, prefill, 1, 5)
    return {"decode_64_ms": decode * 1e3, "prefill_256_ms": prefill_s * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jaxserve-moe-bench")
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
    for name, run in (("jaxserve", run_jaxserve), ("hf", run_hf)):
        results[name] = run(work, args)
        results[name]["output_tok_s"] = output_tokens / results[name]["seconds"]
        print(name, json.dumps(results[name]), flush=True)
    for name, path in (("moe", moe), ("dense", dense)):
        steps[name] = step_times(path, args)
        print(name, json.dumps(steps[name]), flush=True)
    load_after = os.getloadavg()
    ratio = results["jaxserve"]["output_tok_s"] / results["hf"]["output_tok_s"]
    print(f"model: Qwen3-MoE scaled, {EXPERTS} experts top-{TOP_K}, hidden "
          f"{SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers; dense twin MLP "
          f"{TOP_K * EXPERT_WIDTH}; {platform.machine()}, {os.cpu_count()} CPUs; load average "
          f"{load[0]:.1f} before, {load_after[0]:.1f} after ({time.perf_counter() - t0:.0f} s)")
    print(f"workload: {len(work)} requests, {output_tokens} output tokens")
    for name, r in results.items():
        print(f"{name:9s} {r['seconds']:7.1f} s  output {r['output_tok_s']:7.1f} tok/s")
    print(f"jaxserve / HF transformers on the MoE (static batch {args.hf_batch_size}): "
          f"{ratio:.2f}x (target >= 3x)")
    for key in ("decode_64_ms", "prefill_256_ms"):
        m, d = steps["moe"][key], steps["dense"][key]
        print(f"{key}: MoE {m:.1f} ms, dense of equal active parameters {d:.1f} ms: "
              f"{m / d:.2f}x (target <= 1.5x)")
    print(json.dumps({"results": results, "steps": steps, "load": [load, load_after]}))


if __name__ == "__main__":
    main()

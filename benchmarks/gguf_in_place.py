"""GGUF blocks read in place on the CPU (issue 42): SmolLM2's Q4_1 / Q8_0 blocks through the
quantized kernel against the same file dequantized to f32 at load, in one process.

    python benchmarks/gguf_in_place.py [--rounds 3] [--decodes 1,4,16,64] [--engines f32,gguf]
        [--max-num-seqs 64]

Engines, built side by side and taking turns each round:
- f32: `--quantization none` (the path before: the blocks dequantized at load, 540 MB of f32
  weights read per decode step, the f32 in-place kernel from 2 rows);
- gguf: `--quantization gguf` (the default for a GGUF file on one CPU device): the blocks read
  in place by jaxserve/kernels/cpu/quantized_matmul.cc in steps of up to QUANTIZED_MAX_ROWS
  tokens;
- gguf-xla: the same blocks, every step's layers dequantized through XLA (QUANTIZED_MAX_ROWS 0
  while it compiles; the LM head still through the kernel): where the kernel's row limit goes;
- gguf-int8: `--quantization gguf --gguf-dot int8`: steps of up to INT8_DOT_MAX_ROWS tokens
  round x to int8 per block and take integer dot products (llama.cpp's arithmetic).

Prints: the golden greedy tokens of the gguf engines against ../shared/golden (the prompts
together, then each alone); each engine's decode step (forward + greedy sampler, tokens on the
host; best of 5 per round) at --decodes sequences; one request's decode rate (16 prompt tokens, 128
output tokens) and 16 requests' together; the bytes of weights a step reads; the CPU's model and
flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines()
                  if l.startswith("model name")), platform.processor())
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines()
                  if l.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx512", "avx2", "fma", "f16c"))]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(wanted)}"


def weight_bytes(params) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(params))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decodes", default="1,4,16,64")
    ap.add_argument("--engines", default="f32,gguf,gguf-xla")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="also the tokens per step: fewer compiled buckets on a busy host")
    ap.add_argument("--golden", default=str(Path(__file__).resolve().parents[2] / "shared"
                                            / "golden" / "smollm2_golden.json"))
    args = ap.parse_args()
    from throughput import decode_plan, greedy_step_seconds

    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels import matmul

    print(f"cpu: {cpu_line()}; load average at start {os.getloadavg()}", flush=True)
    kw = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_seqs,
              max_model_len=512, num_pages=20 * args.max_num_seqs + 20, progress=False)
    engines = args.engines.split(",")
    llms = {}
    if "f32" in engines:
        llms["f32"] = LLM("smollm2-135m-instruct", quantization="none", **kw)
    if "gguf" in engines:
        llms["gguf"] = LLM("smollm2-135m-instruct", quantization="gguf", **kw)
    if "gguf-xla" in engines:
        limit, matmul.QUANTIZED_MAX_ROWS = matmul.QUANTIZED_MAX_ROWS, 0
        try:
            llms["gguf-xla"] = LLM("smollm2-135m-instruct", quantization="gguf", **kw)
        finally:
            matmul.QUANTIZED_MAX_ROWS = limit
    if "gguf-int8" in engines:
        llms["gguf-int8"] = LLM("smollm2-135m-instruct", quantization="gguf", gguf_dot="int8",
                                **kw)
    print(f"engines built; load average {os.getloadavg()}", flush=True)
    for name, llm in llms.items():
        c = llm.engine.config.model
        print(f"{name}: quantization {c.quantization} {dict(c.gguf_formats)}; weights "
              f"{weight_bytes(llm.engine.runner.params) / 1e6:.0f} MB", flush=True)

    golden = json.loads(Path(args.golden).read_text())
    greedy = SamplingParams(temperature=0, max_tokens=32)
    for name in [e for e in ("gguf", "gguf-xla", "gguf-int8") if e in llms]:
        prompts = [{"prompt_token_ids": c["input_ids"]} for c in golden["cases"]]
        together = llms[name].generate(prompts, greedy)
        # Alone: one-row decode steps (the integer dot products' path); together: 6 rows.
        alone = [llms[name].generate(p, greedy)[0] for p in prompts]
        for how, outs in (("together", together), ("alone", alone)):
            equal = sum(o.outputs[0].token_ids == c["greedy_ids"]
                        for o, c in zip(outs, golden["cases"]))
            print(f"golden {name}, {how}: {equal} of {len(golden['cases'])} prompts equal",
                  flush=True)

    decodes = [int(n) for n in args.decodes.split(",")]
    steps = {(name, n): float("inf") for name in llms for n in decodes}
    prompt = {"prompt_token_ids": golden["cases"][0]["input_ids"][:16]}
    decode = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    batches = [b for b in (1, 16) if b <= args.max_num_seqs]
    rates = {(name, b): 0.0 for name in llms for b in batches}
    for r in range(args.rounds):
        for name, llm in llms.items():
            runner = llm.engine.runner
            for n in decodes:
                plan, _ = decode_plan(runner.shapes, n)
                steps[name, n] = min(steps[name, n], greedy_step_seconds(runner, plan, n, 5))
            for b in batches:
                t0 = time.perf_counter()
                llm.generate([prompt] * b, decode)
                rates[name, b] = max(rates[name, b], 128 * b / (time.perf_counter() - t0))
        print(f"round {r + 1} done; load average {os.getloadavg()}", flush=True)
    for n in decodes:
        base = steps["f32", n]
        print(f"decode step, {n} sequences: " + ", ".join(
            f"{name} {steps[name, n] * 1e3:.1f} ms ({base / steps[name, n]:.2f}x f32)"
            for name in llms))
    for b in batches:
        base = rates["f32", b]
        print(f"{b} request(s) x 128 tokens: " + ", ".join(
            f"{name} {rates[name, b]:.1f} tok/s ({rates[name, b] / base:.2f}x f32)"
            for name in llms))
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

"""Offline throughput: a fixed mixed workload through jaxserve's LLM, optionally against HF
transformers static-batch `generate` on the same weights, workload and machine, in the same run.

Workload (seeded, benchmarks/workload.py): N requests whose prompts are 16-256 tokens cut from
Python's own documentation (`pydoc_data.topics`) and whose outputs are 16-192 tokens, ignore_eos,
greedy.
Both sides produce exactly the requested tokens; HF runs static batches (each batch decodes until
its longest request is done, as static batching does), and only the requested tokens count.

    python benchmarks/throughput.py                       # jaxserve only
    python benchmarks/throughput.py --compare hf          # + HF transformers (pip install .[bench])
    python benchmarks/throughput.py --compare f32         # + jaxserve with --quantization none
    python benchmarks/throughput.py --compare int8        # + jaxserve with --quantization int8
    python benchmarks/throughput.py --compare bf16-kv     # + jaxserve with --kv-cache-dtype bfloat16
    python benchmarks/throughput.py --compare int8-bf16-kv  # + jaxserve with both
    python benchmarks/throughput.py --model DIR --compare hf  # an HF checkpoint directory

After the workload (unless `--no-decode-step`) each jaxserve run also times the engine's
64-sequence decode step (forward over 64 one-token queries at contexts of 46-286 tokens, LM
head, greedy sampler: the compiled programs serving runs) and reports its FLOP rate as a fraction of an f32 matmul peak
measured in the same process (benchmarks/kernels.py). FLOPs: 2 x the parameters in matmuls
(projections, MLP, LM head) x 64 rows, plus attention's 4 x Hq x D per (query, key) pair.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from workload import pydoc_workload  # benchmarks/ is the script's directory

SMOLLM2 = "smollm2-135m-instruct"
# --compare choices that rerun jaxserve with engine settings changed: (their flags, LLM kwargs).
# (The default run reads a GGUF file's blocks in place on the CPU; "f32" dequantizes them at load.)
VARIANTS = {"f32": ("--quantization none", dict(quantization="none")),
            "int8": ("--quantization int8", dict(quantization="int8")),
            "bf16-kv": ("--kv-cache-dtype bfloat16", dict(kv_cache_dtype="bfloat16")),
            "int8-bf16-kv": ("--quantization int8 --kv-cache-dtype bfloat16",
                             dict(quantization="int8", kv_cache_dtype="bfloat16"))}


def run_jaxserve(work, args, **engine) -> dict:
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=512,
              progress=False, **engine)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in work]
    result = {"seconds": elapsed, "startup_seconds": startup,
              "preemptions": llm.engine.stats().num_preemptions}
    if args.decode_step:
        result["decode_step"] = decode_step_figure(llm.engine.runner, args.max_num_seqs)
    return result


def decode_step_figure(runner, num_seqs: int, repeats: int = 5) -> dict:
    """The decode step of `num_seqs` sequences through the runner's warmed programs, as a fraction
    of the f32 matmul peak measured here. It writes K/V into arbitrary pages of the pool: run it
    only once the engine has nothing left to serve."""
    from kernels import measure_peaks

    plan, kv_lens = decode_plan(runner.shapes, num_seqs)
    step = greedy_step_seconds(runner, plan, num_seqs, repeats)
    flops = step_flops(runner.config, num_seqs, num_seqs, int(kv_lens.sum()))
    _, peak = measure_peaks(on_gpu=False)
    return {"num_seqs": num_seqs, "step_ms": step * 1e3, "gflop": flops / 1e9,
            "gflop_s": flops / step / 1e9, "matmul_peak_gflop_s": peak / 1e9,
            "fraction_of_peak": flops / step / peak}


def greedy_step_seconds(runner, plan, num_rows: int, repeats: int) -> float:
    """Best of `repeats` synchronous engine steps over `plan` (forward, greedy sampler on its
    first `num_rows` logits rows, tokens back on the host), after one warm-up step."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.executor.sampling_rows import SamplingRow

    rows = [SamplingRow(SamplingParams(temperature=0, max_tokens=None), 0, [1], [])] * num_rows
    runner.sample(runner.forward(plan), rows)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.sample(runner.forward(plan), rows)  # returns host arrays: the step is done
        best = min(best, time.perf_counter() - t0)
    return best


def step_flops(c, num_tokens: int, num_logits_rows: int, attended_pairs: int) -> int:
    """FLOPs of a step: 2 x the decoder layers' matmul parameters (projections, MLP) per token,
    the LM head per logits row, and attention's 4 x Hq x D per (query, key) pair per layer."""
    H, I, Hq, Hkv, D = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                        c.head_dim)
    layer_params = c.num_layers * (H * (Hq + 2 * Hkv) * D + Hq * D * H + 3 * H * I)
    return (2 * layer_params * num_tokens + 2 * H * c.vocab_size * num_logits_rows
            + 4 * Hq * D * attended_pairs * c.num_layers)


def step_plan(shapes, token_lists, start_positions, num_tokens: int | None = None):
    """One step's plan: each sequence's tokens appended at its start position, in pages of its
    own (page 0 is the null page), padded to `num_tokens` (default: the tokens' bucket)."""
    from jaxserve.executor.batch_plan import SeqChunk, make_plan, pages_for

    chunks, next_page = [], 1
    for tokens, start in zip(token_lists, start_positions):
        n = pages_for(start + len(tokens), shapes.page_size)
        chunks.append(SeqChunk(tokens, start, list(range(next_page, next_page + n))))
        next_page += n
    if next_page > shapes.num_pages:
        raise SystemExit(f"a step of {len(chunks)} sequences needs {next_page} KV pages, the "
                         f"pool has {shapes.num_pages}")
    tokens = num_tokens or shapes.token_bucket(sum(len(t) for t in token_lists))
    return make_plan(chunks, num_tokens_padded=tokens, num_seqs_padded=shapes.seq_bucket(tokens),
                     pages_per_seq=shapes.pages_per_seq, page_size=shapes.page_size,
                     num_rows_padded=shapes.logits_bucket(tokens))


def decode_plan(shapes, num_seqs: int, num_tokens: int | None = None):
    """A decode step's plan: `num_seqs` one-token queries at contexts of 46-286 tokens (seeded),
    padded to `num_tokens` (default: its token bucket); and the contexts."""
    kv_lens = np.random.default_rng(0).integers(46, 287, num_seqs)
    plan = step_plan(shapes, [[1]] * num_seqs, [int(n) - 1 for n in kv_lens], num_tokens)
    return plan, kv_lens


def run_hf(work, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.model_registry import resolve

    path = resolve(args.model).path
    if path.is_dir():  # an HF checkpoint directory (e.g. benchmarks/random_hf_model.py's)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    model.eval()
    pad = model.config.eos_token_id if model.config.pad_token_id is None else \
        model.config.pad_token_id
    t0 = time.perf_counter()
    for i in range(0, len(work), args.hf_batch_size):
        batch = work[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        # Left padding, so every row's next token follows its own last prompt token.
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
    return {"seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--compare", choices=("hf", *VARIANTS), default=None)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--no-decode-step", dest="decode_step", action="store_false",
                   help="skip the 64-sequence decode step's fraction of the f32 matmul peak")
    args = p.parse_args()

    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    work = pydoc_workload(load_tokenizer(resolve(args.model)), args.num_requests,
                          seed=0, prompt_tokens=(16, 256), output_tokens=(16, 192))
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    results = {"jaxserve": run_jaxserve(work, args)}
    if args.compare == "hf":
        results["hf"] = run_hf(work, args)
    if args.compare in VARIANTS:
        results[args.compare] = run_jaxserve(work, args, **VARIANTS[args.compare][1])
    print(f"workload: {len(work)} requests, {prompt_tokens} prompt + {output_tokens} output tokens; "
          f"{platform.machine()} {platform.processor() or ''}".rstrip())
    for name, r in results.items():
        r["output_tok_s"] = output_tokens / r["seconds"]
        r["total_tok_s"] = (prompt_tokens + output_tokens) / r["seconds"]
        print(f"{name:9s} {r['seconds']:7.1f} s  output {r['output_tok_s']:7.1f} tok/s  "
              f"total {r['total_tok_s']:7.1f} tok/s")
    for name, r in results.items():
        if (step := r.get("decode_step")) is not None:
            print(f"{name} decode step, {step['num_seqs']} sequences: {step['step_ms']:.0f} ms, "
                  f"{step['gflop_s']:.1f} GFLOP/s = {step['fraction_of_peak']:.0%} of the f32 "
                  f"matmul peak measured in this run ({step['matmul_peak_gflop_s']:.1f} GFLOP/s)")
    if "hf" in results:
        ratio = results["jaxserve"]["output_tok_s"] / results["hf"]["output_tok_s"]
        print(f"jaxserve / HF transformers (static batch {args.hf_batch_size}): {ratio:.2f}x")
    if args.compare in VARIANTS:
        ratio = results[args.compare]["output_tok_s"] / results["jaxserve"]["output_tok_s"]
        print(f"jaxserve {VARIANTS[args.compare][0]} / the default: {ratio:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

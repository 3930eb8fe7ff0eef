"""Speculative decoding (n-gram drafts) vs plain decoding on an input-grounded workload, same
engine, same run: output tok/s at batch 1 and at batch 64, and greedy identity.

Workload (seeded, benchmarks/workload.py `grounded_workload`): chat requests that summarise,
copy-edit or rewrite a passage of Python's documentation, or document, rename or explain a
function of its standard library; greedy, up to --max-tokens each (both modes produce the same
tokens, checked).

One engine with `speculative_ngram=K` serves both modes: the plain one opts its requests out
(`num_speculative_tokens=0`), so the programs, weights and memory are the same and only the
drafts differ. Prefix caching is off, so every timed request pays its prefill as a new request
would (output tok/s counts the whole request, not decode alone). The first plain pass gives
the reference tokens every other pass must reproduce. Modes alternate (ABBA) over
--rounds rounds; the ratio reported is the median of the per-round ratios, with the load average
beside it (the machine may be shared). Compiled programs come from JAX's persistent cache when
an earlier run left them there.

    python benchmarks/speculative.py                              # batch 1 and batch 64
    python benchmarks/speculative.py --batch-sizes 1 --rounds 5 --num-requests 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import provenance  # benchmarks/ is the script's directory
from workload import grounded_workload

SMOLLM2 = "smollm2-135m-instruct"


def run_mode(llm, work, batch_size: int,
             speculative: bool) -> tuple[float, float, list[list[int]]]:
    """Wall and process CPU seconds (every thread's) to serve `work` in groups of batch_size
    requests at once; the output tokens."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=work[0][1],
                            num_speculative_tokens=None if speculative else 0)
    tokens = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(0, len(work), batch_size):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in work[i:i + batch_size]], params)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return time.perf_counter() - start, time.process_time() - cpu_start, tokens


def measure(llm, work, batch_size: int, rounds: int) -> dict:
    engine = llm.engine
    ratios, cpu_ratios, loads = [], [], []
    rates = {"plain": [], "speculative": []}
    reference, mismatches = None, 0
    drafts0 = engine.stats()
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        seconds, cpu_seconds = {}, {}
        loads.append(os.getloadavg()[0])
        for speculative in order:
            secs, cpu_secs, tokens = run_mode(llm, work, batch_size, speculative)
            name = "speculative" if speculative else "plain"
            seconds[name], cpu_seconds[name] = secs, cpu_secs
            reference = reference or tokens
            mismatches += sum(a != b for a, b in zip(reference, tokens))
        n = sum(len(t) for t in reference)
        for name, secs in seconds.items():
            rates[name].append(n / secs)
        ratios.append(seconds["plain"] / seconds["speculative"])
        cpu_ratios.append(cpu_seconds["plain"] / cpu_seconds["speculative"])
        print(f"  batch {batch_size} round {r + 1}: plain {rates['plain'][-1]:.1f} tok/s, "
              f"speculative {rates['speculative'][-1]:.1f} tok/s, ratio {ratios[-1]:.2f}, "
              f"CPU-time ratio {cpu_ratios[-1]:.2f} (load {loads[-1]:.1f})",
              file=sys.stderr, flush=True)
    stats = engine.stats()
    drafted = stats.num_draft_tokens - drafts0.num_draft_tokens
    stood = stats.num_accepted_draft_tokens - drafts0.num_accepted_draft_tokens
    return {"batch_size": batch_size, "requests": len(work),
            "output_tokens": sum(len(t) for t in reference),
            "plain_tok_s": [round(x, 2) for x in rates["plain"]],
            "speculative_tok_s": [round(x, 2) for x in rates["speculative"]],
            "ratios": [round(x, 3) for x in ratios], "median_ratio": statistics.median(ratios),
            "cpu_time_ratios": [round(x, 3) for x in cpu_ratios],
            "median_cpu_time_ratio": statistics.median(cpu_ratios),
            "load_avg_1min": loads, "greedy_mismatches": mismatches,
            "draft_tokens": drafted, "accepted_draft_tokens": stood,
            "acceptance": stood / drafted if drafted else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--num-requests", type=int, default=8, help="requests of the batch-1 run")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    commit = provenance.commit()  # before anything runs: the tree may change while it does

    from jaxserve import LLM
    from jaxserve.executor.compile_cache import default_compile_cache_dir, enable_compile_cache

    enable_compile_cache(default_compile_cache_dir())
    llm = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024,
              enable_prefix_caching=False, speculative_ngram=args.num_speculative_tokens,
              progress=False)
    results = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        n = args.num_requests if batch_size == 1 else batch_size
        work = grounded_workload(llm.get_tokenizer(), n, seed=args.seed,
                                 max_tokens=args.max_tokens)
        results.append(measure(llm, work, batch_size, args.rounds))
    machine = provenance.cpu()
    print(f"commit {commit}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"{machine}; {args.num_speculative_tokens} speculative tokens, n-gram drafts")
    for r in results:
        print(f"batch {r['batch_size']:3d}: {r['requests']} requests, {r['output_tokens']} output "
              f"tokens; speculative / plain output tok/s, median of {len(r['ratios'])} rounds: "
              f"{r['median_ratio']:.2f}x (rounds {r['ratios']}), CPU-time ratio "
              f"{r['median_cpu_time_ratio']:.2f}x; drafts accepted "
              f"{r['accepted_draft_tokens']}/{r['draft_tokens']}; greedy mismatches "
              f"{r['greedy_mismatches']}; load {r['load_avg_1min']}")
    print(json.dumps({"commit": commit, "machine": machine, "results": results}))
    return 1 if any(r["greedy_mismatches"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

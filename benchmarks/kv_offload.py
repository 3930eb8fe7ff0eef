"""TTFT of a long shared prefix re-sent after the device pool evicted it: with the host tier
(--kv-offloading-size) against without, the same run.

Two SmolLM2 engines (float32, the same small device pool: `--pool-pages` pages of 16 tokens), one
with a host tier of `--offload-gib` GiB and one without. Each round, on each engine in turn: a
request of --prefix-tokens tokens of Python's documentation (pydoc_workload) plus a 16-token
question (the first round computes the prefix and caches it), then a flood of other documentation
prompts as large as the pool (which evicts the prefix from the device), then the prefix again with
another question: its TTFT is the wall time of `LLM.generate` of it with max_tokens=1. Without the
host tier the prefix is computed again; with it, its pages come back from host memory. Reports
the median over `--rounds` of each, their ratio, and the host tier's counters (prompt tokens
restored, bytes moved, host seconds spent on the copies).

    python benchmarks/kv_offload.py [--prefix-tokens 1024] [--rounds 3] [--pool-pages 80]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import provenance  # benchmarks/ is the script's directory
from jaxserve import LLM, SamplingParams
from workload import pydoc_workload

SMOLLM2 = "smollm2-135m-instruct"
PAGE = 16


def _ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool-pages", type=int, default=80, help="device KV pool (pages of 16)")
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    args = ap.parse_args()
    commit = provenance.commit()  # before anything runs: the tree may change while it does
    if args.pool_pages * PAGE < args.prefix_tokens + 2 * PAGE:
        ap.error("the pool must hold the prefix and its question")
    common = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=args.budget,
                  max_model_len=args.prefix_tokens + 64, page_size=PAGE,
                  num_pages=args.pool_pages + 1, strict_compile=True, progress=False)
    engines = {"offload": LLM(SMOLLM2, kv_offloading_size=args.offload_gib, **common),
               "recompute": LLM(SMOLLM2, **common)}
    tokenizer = engines["offload"].engine.tokenizer
    # The prefix, its questions and the floods: documentation text no prompt shares a page with.
    flood_len = min(args.prefix_tokens, args.pool_pages * PAGE // 2)
    n_floods = -(-args.pool_pages * PAGE // flood_len)
    work = pydoc_workload(tokenizer, 1 + (1 + n_floods) * args.rounds, seed=0,
                          prompt_tokens=(flood_len, flood_len), output_tokens=(1, 1))
    prefix = pydoc_workload(tokenizer, 1, seed=1, prompt_tokens=(args.prefix_tokens,) * 2,
                            output_tokens=(1, 1))[0][0]
    questions = [tokenizer.encode(f" Question {i}: what does this section say about it?",
                                  add_special_tokens=False)[:PAGE]
                 for i in range(args.rounds + 1)]
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    cold: dict[str, float] = {}
    for name, llm in engines.items():
        cold[name] = _ttft(llm, prefix + questions[0])
    for r in range(args.rounds):
        floods = [p for p, _ in work[1 + r * (1 + n_floods):(r + 1) * (1 + n_floods)]]
        for name, llm in engines.items():
            for f in floods:
                _ttft(llm, f)
            ttft[name].append(_ttft(llm, prefix + questions[r + 1]))
            print(json.dumps({"round": r, "engine": name, "ttft_s": round(ttft[name][-1], 3)}),
                  flush=True)
    stats = engines["offload"].engine.stats()
    med = {k: statistics.median(v) for k, v in ttft.items()}
    print(json.dumps({
        "commit": commit, "cpu": provenance.cpu(), "prefix_tokens": args.prefix_tokens, "pool_pages": args.pool_pages,
        "offload_gib": args.offload_gib, "rounds": args.rounds, "budget": args.budget,
        "load_average": os.getloadavg(),
        "cold_ttft_s": {k: round(v, 3) for k, v in cold.items()},
        "resent_ttft_median_s": {k: round(v, 3) for k, v in med.items()},
        "resent_ttft_s": {k: [round(x, 3) for x in v] for k, v in ttft.items()},
        "ratio_recompute_over_offload": round(med["recompute"] / med["offload"], 2),
        "host_tier": {"tokens_restored": stats.kv_offload_hits,
                      "tokens_missed": stats.kv_offload_queries - stats.kv_offload_hits,
                      "bytes_to_host": stats.kv_offload_bytes_to_host,
                      "bytes_to_device": stats.kv_offload_bytes_to_device,
                      "copy_seconds": round(stats.kv_offload_seconds, 3),
                      "pages_held": stats.kv_offload_pages,
                      "capacity_pages": stats.kv_offload_capacity_pages},
        "recompute_prefix_hits": engines["recompute"].engine.stats().prefix_cache_hits,
    }, indent=1))


if __name__ == "__main__":
    main()

"""Multi-turn chat whose working set is about 4x the device KV pool: prefill tokens saved and TTFT
p50/p99 without a KV tier, with the host tier (--kv-offloading-size) and with a small host tier
over a disk tier (--kv-offloading-disk-path/-size), the same run.

Three SmolLM2 engines (float32, the same device pool of --pool-pages pages of 16 tokens, derived
from the workload when not given: the working set, every conversation's final history, over 4)
replay `workload.multi_turn_workload` (conversations taking turns round-robin, so each turn's
history was pushed out of the device pool by the others since its last turn). Each request is
sent to the three engines in turn (so a change in the host's load falls on all three alike),
one request at a time, max_tokens=1: its TTFT is RequestMetrics' first token time less its
arrival. The "host" engine's host tier holds the whole working set; the "host+disk" engine's
host tier a quarter of it and its disk tier the whole (in a temporary directory).

    python benchmarks/multi_turn_kv.py [--conversations 6] [--turns 3] [--pool-pages N]
                                       [--engines host+disk]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import provenance  # benchmarks/ is the script's directory
from jaxserve import LLM, SamplingParams
from jaxserve.executor.kv_files import file_bytes
from jaxserve.model_registry import resolve
from jaxserve.tokenizer import load_tokenizer
from workload import multi_turn_workload

SMOLLM2 = "smollm2-135m-instruct"
PAGE = 16
GIB = 1 << 30
# SmolLM2 in float32: 30 layers x 16 tokens x 2 x 3 KV heads x 64 x 4 bytes
PAGE_BYTES = 30 * PAGE * 2 * 3 * 64 * 4


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--pool-pages", type=int, help="device KV pool (default: working set / 4)")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="none,host,host+disk",
                    help="which of the three engines to run (comma-separated)")
    args = ap.parse_args()
    commit = provenance.commit()  # before anything runs: the tree may change while it does
    chats = multi_turn_workload(args.conversations, args.turns, seed=args.seed)
    base = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=args.budget,
                page_size=PAGE, strict_compile=True, progress=False)
    tokenizer = load_tokenizer(resolve(SMOLLM2))
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]
    working_set = sum(len(p) for p in prompts[-args.conversations:])  # the final histories
    longest = max(len(p) for p in prompts)
    pool_pages = args.pool_pages or max(-(-working_set // (4 * PAGE)), longest // PAGE + 4)
    ws_pages = -(-working_set // PAGE)
    tier_dir = tempfile.mkdtemp(prefix="jaxserve-kv-")
    common = dict(base, max_model_len=longest + 16, num_pages=pool_pages + 1)
    engines = {
        "none": lambda: LLM(SMOLLM2, **common),
        "host": lambda: LLM(SMOLLM2, kv_offloading_size=(ws_pages + 8) * PAGE_BYTES / GIB,
                            **common),
        "host+disk": lambda: LLM(SMOLLM2, kv_offloading_size=(ws_pages // 4) * PAGE_BYTES / GIB,
                                 kv_offloading_disk_path=os.path.join(tier_dir, "tier"),
                                 kv_offloading_disk_size=(ws_pages + 8)
                                 * file_bytes(PAGE, PAGE_BYTES) / GIB, **common)}
    picked = args.engines.split(",")
    engines = {k: v() for k, v in engines.items() if k in picked}
    ttft: dict[str, list[float]] = {k: [] for k in engines}
    cached: dict[str, int] = {k: 0 for k in engines}
    for i, prompt in enumerate(prompts):
        for name, llm in engines.items():
            out = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(max_tokens=1, temperature=0))[0]
            ttft[name].append(out.metrics.first_token_time - out.metrics.arrival_time)
            cached[name] += out.num_cached_tokens
        print(json.dumps({"request": i, "prompt_tokens": len(prompt),
                          **{k: round(v[-1], 3) for k, v in ttft.items()}}), flush=True)
    total = sum(len(p) for p in prompts)
    result = {"commit": commit, "cpu": provenance.cpu(), "load_average": os.getloadavg(),
              "conversations": args.conversations, "turns": args.turns,
              "requests": len(prompts), "prompt_tokens": total, "working_set_tokens": working_set,
              "pool_pages": pool_pages, "working_set_over_pool": round(
                  working_set / (pool_pages * PAGE), 2), "budget": args.budget, "engines": {}}
    for name, llm in engines.items():
        s = llm.engine.stats()
        result["engines"][name] = {
            "prefill_tokens_computed": total - cached[name],
            "prefill_tokens_saved": cached[name],
            "ttft_p50_s": round(_p(ttft[name], 50), 3), "ttft_p99_s": round(_p(ttft[name], 99), 3),
            "ttft_mean_s": round(statistics.mean(ttft[name]), 3),
            "device_prefix_hits": s.prefix_cache_hits - s.kv_offload_hits,
            "host_tier_hits": s.kv_offload_hits - s.kv_disk_hits, "disk_tier_hits": s.kv_disk_hits,
            "host_tier_pages": s.kv_offload_capacity_pages,
            "disk_tier_pages": s.kv_disk_capacity_pages,
            "tier_seconds": round(s.kv_offload_seconds + s.kv_disk_seconds, 3),
            "disk_tier_seconds": round(s.kv_disk_seconds, 3)}
    none = result["engines"].get("none")
    for name in ("host", "host+disk"):
        if none is None or name not in engines:
            continue
        e = result["engines"][name]
        e["ttft_p50_ratio_none_over_this"] = round(none["ttft_p50_s"] / e["ttft_p50_s"], 2)
        e["ttft_p99_ratio_none_over_this"] = round(none["ttft_p99_s"] / e["ttft_p99_s"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The host's gap between engine steps through `jaxserve serve`, async scheduling off and on.

For each mode a server is started (as users run it, serving.py's engine flags) and serving.py's
workload is sent at concurrency 1 and then 16 (streaming /v1/completions, greedy, ignore_eos).
Around each load the server's /metrics are read: the engine's step gaps (jaxserve.core.step_gaps:
the seconds from a step's tokens being ready to the next step's launch, and the steps launched
before the previous one finished) give the mean host gap per step; the client gives output tok/s
and TPOT. The report is the two modes side by side and on / off ratios, from one run.

    python benchmarks/step_gap.py                      # SmolLM2, 8 requests at 1, 32 at 16
    python benchmarks/step_gap.py --flags=--quantization=int8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import urllib.request

import provenance  # benchmarks/ is the script's directory
from serving import ROOT, add_engine_args, run_load, serve_flags, summarize
from workload import pydoc_workload

GAP_METRICS = ("engine_step_gaps", "engine_step_gap_seconds", "engine_steps_queued_ahead")


def scrape(url: str) -> dict[str, float]:
    """The engine's step-gap counters from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics") as resp:
        text = resp.read().decode()
    out = dict.fromkeys(GAP_METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("jaxserve:")
        if name in out:
            out[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def one_mode(args, loads, extra_flags: list[str]) -> dict:
    from jaxserve.entrypoints.process import ServerProcess

    log = tempfile.NamedTemporaryFile("w", prefix="jaxserve-serve-", suffix=".log", delete=False)
    print(f"starting jaxserve serve {' '.join(extra_flags)} (log: {log.name})", file=sys.stderr,
          flush=True)
    # A loaded machine may take long to compile the first time (the cache serves the second).
    server = ServerProcess(serve_flags(args) + extra_flags, log, cwd=ROOT, ready_timeout_s=1800)
    out = {}
    try:
        for concurrency, work in loads:
            before = scrape(server.url)
            results, seconds = asyncio.run(run_load(server.url, args.model, work, float("inf"),
                                                    concurrency, args.seed))
            after = scrape(server.url)
            delta = {k: after[k] - before[k] for k in GAP_METRICS}
            summary = summarize(results, seconds, work, 2.0, 0.5)
            gaps = delta["engine_step_gaps"]
            out[concurrency] = {
                "output_tok_s": summary["output_tok_s"], "errors": summary["errors"],
                "tpot_p50_ms": 1000 * summary["tpot_s"]["p50"],
                "ttft_p50_ms": 1000 * summary["ttft_s"]["p50"],
                "steps_measured": gaps,
                "mean_gap_ms": 1000 * delta["engine_step_gap_seconds"] / gaps if gaps else None,
                "queued_ahead_fraction": (delta["engine_steps_queued_ahead"] / gaps
                                          if gaps else None)}
            print(f"  {' '.join(extra_flags) or 'default'} x{concurrency}: {out[concurrency]}",
                  flush=True)
    finally:
        server.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests-at-1", type=int, default=8)
    p.add_argument("--requests-at-16", type=int, default=32)
    p.add_argument("--flags", default="", help="more `jaxserve serve` flags for both modes")
    p.add_argument("--result-json", help="also write the report here")
    args = p.parse_args()
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    commit = provenance.commit()
    tokenizer = load_tokenizer(resolve(args.model))
    loads = [(c, pydoc_workload(tokenizer, n, seed=args.seed, prompt_tokens=(32, 384),
                                output_tokens=(16, 128)))
             for c, n in ((1, args.requests_at_1), (16, args.requests_at_16))]
    flags = shlex.split(args.flags)
    started = time.strftime("%H:%M")
    load_before = os.getloadavg()
    off = one_mode(args, loads, flags + ["--no-async-scheduling"])
    on = one_mode(args, loads, flags)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
              "cpu": provenance.cpu(),
              "date": time.strftime("%Y-%m-%d"), "time": f"{started}-{time.strftime('%H:%M')}",
              "load_average": [load_before, os.getloadavg()], "commit": commit,
              "command": " ".join(sys.argv), "off": off, "on": on,
              "on_over_off_tok_s": {c: on[c]["output_tok_s"] / off[c]["output_tok_s"]
                                    for c in on}}
    print(json.dumps(report, indent=1))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

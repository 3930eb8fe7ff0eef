"""guidellm (vLLM's load-testing tool) against `jaxserve serve`, beside benchmarks/serving.py's
client on the same workload and the same server.

The script starts `jaxserve serve` (a child process, as users run it), runs `guidellm run` at it
as a subprocess (fixed-length synthetic prompts, N concurrent streams, bounded by a request count
and a duration), and sends the same shape of workload (same prompt/output lengths, same number of
requests, same concurrency, prompts cut from `pydoc_data.topics`) through serving.py's aiohttp
client to the same warm server before and after guidellm's run (other jobs' load drifts; the
bracket shows by how much), and prints the three runs' throughput / TTFT / TPOT side by side.
It reads the server's `jaxserve:requests_total` by outcome around guidellm's run: any outcome
but `ok` (a 4xx for one of guidellm's requests, say) fails the run.

guidellm pulls torch and transformers; it may live in a venv of its own, pointed at with
--guidellm (default: `guidellm` on PATH):

    python3 -m venv /work/venv-guidellm && /work/venv-guidellm/bin/pip install guidellm
    python benchmarks/guidellm_serving.py --guidellm /work/venv-guidellm/bin/guidellm

guidellm needs a Hugging Face tokenizer to make synthetic prompts of a given token length; the
script writes the served model's own tokenizer (jaxserve's, as tokenizer.json) to a temporary
directory and passes that, so nothing is fetched from the hub (HF_HUB_OFFLINE=1).

Differences between the two clients, by design of guidellm: it sends text prompts (so the server
re-tokenizes them; lengths can differ from the requested count by a token or two) with
`stream_options: {"include_usage": true, "continuous_usage_stats": true}`, `ignore_eos` and
`stop: null`; serving.py sends token-id prompts with `include_usage` only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import provenance  # benchmarks/ is the script's directory
import serving
from workload import pydoc_workload

ROOT = Path(__file__).resolve().parents[1]


def export_tokenizer(tokenizer, directory: Path) -> Path:
    """The model's tokenizer as an HF tokenizer directory (what AutoTokenizer loads)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token}))
    return directory


def run_guidellm(exe: str, root_url: str, tokenizer_dir: Path, args, out: Path) -> dict:
    """One `guidellm run` (concurrent profile); its benchmarks.json report."""
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={root_url},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--constraint", f"kind=max_requests,count={args.num_requests}",
           "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                     f"output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--seed", f"kind=static,value={args.seed}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=env, timeout=args.max_seconds + 300)
    return json.loads(out.read_text())


def summarize_guidellm(report: dict) -> dict:
    """The report's one benchmark in serving.py's terms: rates are its tokens over its measured
    duration (as serving.py's over its wall time); guidellm's per-request `inter_token_latency`,
    (last token - first) / (tokens - 1), is what serving.py calls TPOT."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stats(name: str) -> dict:
        s = m[name]["successful"]
        return {"mean": s["mean"] / 1e3, "p50": s["median"] / 1e3,
                "p99": s["percentiles"]["p99"] / 1e3}

    totals = m["request_totals"]
    seconds = bench["duration"]
    return {"requests": totals["successful"], "errors": totals["errored"],
            "incomplete": totals["incomplete"], "seconds": seconds,
            "request_throughput": totals["successful"] / seconds,
            "output_tok_s": m["output_token_count"]["successful"]["total_sum"] / seconds,
            "ttft_s": stats("time_to_first_token_ms"), "tpot_s": stats("inter_token_latency_ms")}


def request_outcomes(v1_url: str) -> dict[str, float]:
    """`jaxserve:requests_total` summed by outcome, from the server's /metrics."""
    root = v1_url.removesuffix("/v1")
    text = urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
    outcomes: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:requests_total{"):
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            outcomes[outcome] = outcomes.get(outcome, 0.0) + float(value)
    return outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default=shutil.which("guidellm"),
                   help="the guidellm executable (default: guidellm on PATH)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-seconds", type=int, default=240, help="bound on guidellm's run")
    p.add_argument("--seed", type=int, default=0)
    serving.add_engine_args(p)
    p.add_argument("--result-json", type=Path, help="also write the result here")
    args = p.parse_args()
    if not args.guidellm:
        p.error("guidellm not found: install it (pip install guidellm, or the bench extra) "
                "or pass --guidellm PATH")

    from jaxserve.model_registry import resolve
    from jaxserve.entrypoints.process import ServerProcess
    from jaxserve.tokenizer import load_tokenizer

    commit = provenance.commit()  # before anything runs: the tree may change while it does
    tokenizer = load_tokenizer(resolve(args.model))
    work = pydoc_workload(tokenizer, args.num_requests, seed=args.seed,
                          prompt_tokens=(args.prompt_tokens,) * 2,
                          output_tokens=(args.output_tokens,) * 2)
    tmp = Path(tempfile.mkdtemp(prefix="guidellm-serving-"))
    tokenizer_dir = export_tokenizer(tokenizer, tmp / "tokenizer")
    log = (tmp / "serve.log").open("w")
    print(f"starting jaxserve serve (log: {log.name})", file=sys.stderr, flush=True)
    server = ServerProcess(serving.serve_flags(args), log, cwd=ROOT)
    load = {}  # the 1-minute load average after each phase: the machine may be shared

    def serving_py(phase: str) -> dict:
        results, seconds = asyncio.run(serving.run_load(
            server.url, args.model, work, float("inf"), args.concurrency, args.seed))
        load[phase] = os.getloadavg()[0]
        summary = serving.summarize(results, seconds, work, float("inf"), float("inf"))
        for key in ("goodput_req_s", "slo"):  # no SLO here: guidellm has no goodput without one
            summary.pop(key)
        return summary

    try:
        # serving.py's client before and after guidellm: other jobs' load drifts, and
        # bracketing shows how much (the ratio is against the mean of the two).
        before = serving_py("serving.py before")
        outcomes_before = request_outcomes(server.url)
        guide = summarize_guidellm(run_guidellm(args.guidellm, server.url.removesuffix("/v1"),
                                                tokenizer_dir, args, tmp / "benchmarks.json"))
        load["guidellm"] = os.getloadavg()[0]
        outcomes = {k: v - outcomes_before.get(k, 0.0)
                    for k, v in request_outcomes(server.url).items()}
        after = serving_py("serving.py after")
    finally:
        server.stop()
        log.close()
    runs = {"serving.py before": before, "guidellm": guide, "serving.py after": after}
    baseline_tok_s = (before["output_tok_s"] + after["output_tok_s"]) / 2
    report = {"machine": provenance.cpu(), "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "command": " ".join(sys.argv),
              "workload": {"requests": args.num_requests, "concurrency": args.concurrency,
                           "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens},
              "engine": serving.engine_kwargs(args), "runs": runs,
              "server_outcomes_during_guidellm": outcomes, "load_average_1m": load,
              "guidellm_over_serving_py_tok_s": guide["output_tok_s"] / baseline_tok_s}
    print(f"{'':17} {'req/s':>6} {'out tok/s':>9}  TTFT p50 / p99 (s)  TPOT p50 / p99 (ms)  load")
    for name, r in runs.items():
        print(f"{name:17} {r['request_throughput']:6.2f} {r['output_tok_s']:9.1f}  "
              f"{r['ttft_s']['p50']:6.2f} / {r['ttft_s']['p99']:6.2f}    "
              f"{r['tpot_s']['p50'] * 1e3:6.0f} / {r['tpot_s']['p99'] * 1e3:6.0f}     "
              f"{load[name]:.1f}")
    print(f"guidellm / serving.py output tok/s: {report['guidellm_over_serving_py_tok_s']:.2f}")
    print(f"server outcomes during guidellm's run: {outcomes}")
    print(json.dumps(report))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    bad = {k: v for k, v in outcomes.items() if k != "ok"}
    failed = guide["errors"] or any(r["errors"] or r["wrong_token_counts"] for r in (before, after))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving load test, after vLLM's benchmark_serving: a fixed-seed workload sent as streaming
/v1/completions requests (at a Poisson rate or all at once, under a concurrency cap) to an
OpenAI-compatible server; reports TTFT / TPOT / ITL (mean, p50, p99), request throughput, output
tok/s and goodput under a TTFT/TPOT SLO.

Workload (seeded): prompts of 32-384 tokens cut from Python's own documentation
(`pydoc_data.topics`, text none of us wrote), outputs of 16-128 tokens, greedy, ignore_eos, so
every request produces exactly its tokens however it is served.

Without --base-url the script starts `jaxserve serve` itself (a child process, as users run it)
with the engine flags below, and afterwards runs the same workload through the offline
`LLM.generate` on the same engine settings in this process: the ratio of the two output rates is
what serving costs (HTTP, SSE, the asyncio bridge) over the bare engine loop.

With --compare llamacpp the same workload then goes, at the same concurrency, to llama.cpp's
own `llama-server` (built from source by benchmarks/setup_llamacpp.py; continuous batching, one
slot per concurrent stream, --llamacpp-threads threads) serving the same GGUF file, and the
report gives jaxserve's output tok/s over llama.cpp's. llama-server closes a reused keep-alive
connection, so its requests each open their own.

    python benchmarks/serving.py                             # server + offline baseline
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --no-baseline  # any server
    python benchmarks/serving.py --max-concurrency 16 --compare llamacpp --no-baseline
    python benchmarks/serving.py --policy benchmarks/data/policy.toml --no-baseline

With --policy FILE the workload runs twice, each on a fresh server: without a policy, then with
`--policy FILE --audit-log <temp dir>` (the input and output filters, one audit record per
request); `policy_over_plain` is the ratio of the two output rates (the issue's goal: the
filters cost under 5%).

With --otlp the workload runs again on a fresh server started with --otlp-traces-endpoint, its
spans sent to an OTLP/HTTP receiver in this process (tests/otlp_receiver.py: it decodes them);
`traced_over_plain` is the ratio of the two output rates (issue 39's goal: above 0.98 at 32
streams: `--max-concurrency 32 --otlp`). `--otlp-rounds N` alternates plain and traced runs N
times (plain, traced, plain, traced, ...; each on a fresh server), so a machine whose load drifts
during the run weighs on both sides: `traced_rounds` lists each pair, and `traced_over_plain` is
then the ratio of the summed output tokens per summed second, traced over plain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

import provenance  # benchmarks/ is the script's directory
from workload import pydoc_workload

SMOLLM2 = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first token
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried tokens
    error: str | None = None


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
    async with session.post(f"{url}/completions", json=body) as resp:
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return result
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
                return result
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    result.e2e = time.perf_counter() - start
    return result


async def run_load(url: str, model: str, work, request_rate: float, max_concurrency: int | None,
                   seed: int, *, reuse_connections: bool = True
                   ) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at request_rate/s, or all at once if inf), at most
    max_concurrency in flight; returns the results and the wall time. reuse_connections=False:
    a connection per request."""
    rng = random.Random(seed + 1)
    gate = asyncio.Semaphore(max_concurrency or len(work))
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0, force_close=not reuse_connections)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def limited(prompt, max_tokens):
            async with gate:
                return await one_request(session, url, model, prompt, max_tokens)

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p99": float(p99)}


def summarize(results: list[RequestResult], seconds: float, work, slo_ttft: float,
              slo_tpot: float) -> dict:
    errors = [r.error for r in results if r.error is not None]
    done = [r for r in results if r.error is None]
    wrong = sum(r.output_tokens != n for r, (_, n) in zip(results, work) if r.error is None)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    good = sum(r.ttft <= slo_ttft and (r.output_tokens <= 1 or
                                       (r.e2e - r.ttft) / (r.output_tokens - 1) <= slo_tpot)
               for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(results), "errors": len(errors), "first_errors": errors[:3],
        "wrong_token_counts": wrong, "seconds": seconds,
        "request_throughput": len(done) / seconds, "output_tok_s": output_tokens / seconds,
        "output_tokens": output_tokens,
        "ttft_s": _stats([r.ttft for r in done]), "tpot_s": _stats(tpot),
        "itl_s": _stats([gap for r in done for gap in r.itl]),
        "goodput_req_s": good / seconds, "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
    }


def run_offline(args, work) -> dict:
    """The same workload through LLM.generate, all requests submitted at once."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(args.model, progress=False, **engine_kwargs(args))
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in work)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "request_throughput": len(work) / seconds}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags engine_kwargs/serve_flags read (shared with guidellm_serving.py)."""
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--dtype", default=None,
                   help="the engine's dtype (default: the model's; e.g. bfloat16 on a GPU)")
    p.add_argument("--quantization", default=None,
                   help="the engine's --quantization (e.g. gguf: a GGUF file's blocks read in "
                        "place; default: the engine's)")
    p.add_argument("--gguf-dot", default=None,
                   help="the engine's --gguf-dot (with --quantization gguf: int8 takes llama.cpp's "
                        "integer dot products at decode rows; default: the engine's)")


def engine_kwargs(args) -> dict:
    kwargs = {"max_model_len": args.max_model_len, "num_pages": args.num_pages,
              "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    for name in ("dtype", "quantization", "gguf_dot"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def serve_flags(args) -> list[str]:
    # --no-rag: this measures generation; the retrieval encoder would only lengthen startup.
    flags = ["--model", args.model, "--host", "127.0.0.1", "--port", "0", "--no-rag"]
    for name, value in engine_kwargs(args).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def start_llama_server(args, log) -> tuple[subprocess.Popen, str]:
    """llama.cpp's llama-server on the model's GGUF file, one slot per concurrent stream; its
    /v1 URL once /health answers 200."""
    from setup_llamacpp import llama_server

    from jaxserve.model_registry import resolve

    spec = resolve(args.model)
    if spec.format != "gguf":
        raise SystemExit(f"--compare llamacpp needs a GGUF model, {args.model} is {spec.format}")
    slots = args.max_concurrency or args.num_requests
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(llama_server()), "-m", str(spec.path), "--host", "127.0.0.1", "--port", str(port),
         "--parallel", str(slots), "--cont-batching", "--threads", str(args.llamacpp_threads),
         "--ctx-size", str(slots * args.max_model_len)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, f"{url}/v1"
        except OSError:  # not listening yet, or 503 while the model loads
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server did not get ready (log: {log.name})")


def serve_and_load(args, work, extra_flags: list[str]) -> dict:
    """Run the workload on --base-url, or on a `jaxserve serve` started with `extra_flags`;
    the summary."""
    server = None
    url = args.base_url
    if url is None:
        from jaxserve.entrypoints.process import ServerProcess

        log = tempfile.NamedTemporaryFile("w", prefix="jaxserve-serve-", suffix=".log",
                                          delete=False)
        print(f"starting jaxserve serve {' '.join(extra_flags)} (log: {log.name})",
              file=sys.stderr, flush=True)
        server = ServerProcess(serve_flags(args) + extra_flags, log, cwd=ROOT)
        url = server.url
    try:
        results, seconds = asyncio.run(run_load(url, args.model, work, args.request_rate,
                                                args.max_concurrency, args.seed))
    finally:
        if server is not None:
            server.stop()
    return summarize(results, seconds, work, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)


def _rate(runs: list[dict]) -> float:
    """Output tokens per second over several runs together."""
    return (sum(r["output_tok_s"] * r["seconds"] for r in runs)
            / sum(r["seconds"] for r in runs))


def _fmt(stats: dict, scale: float = 1000.0) -> str:
    return " ".join(f"{k} {v * scale:.1f}" for k, v in stats.items() if v is not None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="an OpenAI-compatible /v1 URL (default: start jaxserve)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    add_engine_args(p)
    p.add_argument("--no-baseline", action="store_true", help="skip the offline LLM.generate run")
    p.add_argument("--result-json", type=Path, help="also write the result here")
    p.add_argument("--compare", choices=("llamacpp",),
                   help="also serve the workload with llama.cpp's llama-server")
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    p.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="run again with this policy (and an audit log) and compare")
    p.add_argument("--otlp", action="store_true",
                   help="run again exporting traces (--otlp-traces-endpoint) and compare")
    p.add_argument("--otlp-rounds", type=int, default=1, metavar="N",
                   help="with --otlp: alternate plain and traced runs N times")
    args = p.parse_args()

    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    commit = provenance.commit()  # before anything runs: the tree may change while it does
    work = pydoc_workload(load_tokenizer(resolve(args.model)), args.num_requests,
                          seed=args.seed, prompt_tokens=(32, 384), output_tokens=(16, 128))
    if (args.policy is not None or args.otlp) and args.base_url is not None:
        p.error("--policy and --otlp start their own servers: not with --base-url")
    serving = serve_and_load(args, work, [])
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "command": " ".join(sys.argv),
              "workload": {"requests": len(work), "seed": args.seed,
                           "prompt_tokens": sum(len(w) for w, _ in work),
                           "output_tokens": sum(n for _, n in work),
                           "request_rate": (args.request_rate if args.request_rate != float("inf")
                                            else "inf"),  # JSON has no Infinity
                           "max_concurrency": args.max_concurrency},
              "engine": engine_kwargs(args), "serving": serving}
    print(f"serving: {serving['requests']} requests ({serving['errors']} errors) in "
          f"{serving['seconds']:.1f} s: {serving['request_throughput']:.2f} req/s, "
          f"{serving['output_tok_s']:.1f} output tok/s, goodput "
          f"{serving['goodput_req_s']:.2f} req/s")
    for name in ("ttft_s", "tpot_s", "itl_s"):
        print(f"  {name[:-2].upper()} ms: {_fmt(serving[name])}")
    if args.compare == "llamacpp":
        log = tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log",
                                          delete=False)
        print(f"starting llama-server (log: {log.name})", file=sys.stderr, flush=True)
        proc, llama_url = start_llama_server(args, log)
        try:
            results, seconds = asyncio.run(run_load(
                llama_url, args.model, work, args.request_rate, args.max_concurrency, args.seed,
                reuse_connections=False))
        finally:
            proc.terminate()
            proc.wait(30)
        llamacpp = summarize(results, seconds, work, args.slo_ttft_ms / 1000,
                             args.slo_tpot_ms / 1000)
        report["llamacpp"] = llamacpp
        report["jaxserve_over_llamacpp"] = serving["output_tok_s"] / llamacpp["output_tok_s"]
        print(f"llama-server: {llamacpp['errors']} errors, {llamacpp['output_tok_s']:.1f} output "
              f"tok/s, TPOT ms: {_fmt(llamacpp['tpot_s'])}; jaxserve / llama.cpp = "
              f"{report['jaxserve_over_llamacpp']:.2f}")
    if args.policy is not None:
        with tempfile.TemporaryDirectory(prefix="jaxserve-audit-") as audit:
            policy = serve_and_load(args, work, ["--policy", str(args.policy), "--audit-log",
                                                 audit])
        report["with_policy"] = policy
        report["policy_over_plain"] = policy["output_tok_s"] / serving["output_tok_s"]
        print(f"with --policy {args.policy}: {policy['output_tok_s']:.1f} output tok/s "
              f"({policy['errors']} errors); policy / plain = {report['policy_over_plain']:.3f}")
    if args.otlp:
        sys.path.insert(0, str(ROOT))
        from tests.otlp_receiver import Receiver  # decodes the exports, as a collector does

        rounds, plain = [], serving
        for i in range(args.otlp_rounds):
            if i:  # alternated: the machine's load drifts over a long run
                plain = serve_and_load(args, work, [])
            receiver = Receiver()
            try:
                traced = serve_and_load(args, work, ["--otlp-traces-endpoint", receiver.url])
            finally:
                receiver.close()  # the server has stopped: its spans were sent
            traced = {**traced, "spans_received": len(receiver.spans)}
            rounds.append({"plain": plain, "traced": traced,
                           "traced_over_plain": traced["output_tok_s"] / plain["output_tok_s"]})
            print(f"round {i + 1}: plain {plain['output_tok_s']:.1f}, traced "
                  f"{traced['output_tok_s']:.1f} output tok/s ({traced['spans_received']} "
                  f"spans received)", file=sys.stderr, flush=True)
        report["traced"] = traced
        report["traced_rounds"] = rounds
        report["traced_over_plain"] = (_rate([r["traced"] for r in rounds])
                                       / _rate([r["plain"] for r in rounds]))
        print(f"with --otlp-traces-endpoint: {traced['output_tok_s']:.1f} output tok/s "
              f"({traced['errors']} errors, {len(receiver.spans)} spans received); "
              f"traced / plain = "
              f"{report['traced_over_plain']:.3f}")
    if not args.no_baseline:
        offline = run_offline(args, work)
        report["offline"] = offline
        report["serving_over_offline"] = serving["output_tok_s"] / offline["output_tok_s"]
        print(f"offline LLM.generate: {offline['output_tok_s']:.1f} output tok/s in "
              f"{offline['seconds']:.1f} s; serving / offline = "
              f"{report['serving_over_offline']:.2f}")
    print(json.dumps(report))
    if args.result_json:
        args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    runs = [serving] + [report[k] for k in ("llamacpp", "with_policy") if k in report] + [
        run for r in report.get("traced_rounds", ()) for run in r.values() if isinstance(run, dict)]
    return 1 if any(r["errors"] or r["wrong_token_counts"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

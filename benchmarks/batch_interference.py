"""What a running Batch API batch costs live traffic: interactive TTFT (p50, p99) of the same
seeded streaming workload (benchmarks/serving.py's) on one `jaxserve serve`, first alone, then
while a batch of long completions runs (the batch's lines at the lowest priority class, at most
--batch-max-concurrent-lines at once). Prints one JSON report: both runs, `ttft_p99_ratio`
(with the batch over without; 1.0 is no cost) and the machine (CPU model and SIMD flags).

    python benchmarks/batch_interference.py                      # SmolLM2, CPU defaults
    python benchmarks/batch_interference.py --batch-lines 256 --batch-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import openai

import provenance  # benchmarks/ is the script's directory
import serving
from workload import pydoc_workload

ROOT = Path(__file__).resolve().parents[1]


def _batch_file(work, model: str, max_tokens: int) -> bytes:
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}}
             for i, (prompt, _) in enumerate(work)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _live(args, url: str, model: str, work) -> dict:
    results, seconds = asyncio.run(serving.run_load(url, model, work, args.request_rate,
                                                    args.max_concurrency, args.seed))
    return serving.summarize(results, seconds, work, slo_ttft=1.0, slo_tpot=0.1)


def main() -> int:
    from jaxserve.entrypoints.process import ServerProcess
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serving.add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=48, help="interactive requests per run")
    p.add_argument("--request-rate", type=float, default=2.0, help="interactive requests/s")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--batch-lines", type=int, default=128)
    p.add_argument("--batch-max-tokens", type=int, default=256)
    p.add_argument("--batch-concurrency", type=int, default=8,
                   help="the server's --batch-max-concurrent-lines")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "serve.log", "w") as log:
        server = ServerProcess(serving.serve_flags(args) + [
            "--data-dir", tmp, "--batch-max-concurrent-lines", str(args.batch_concurrency)],
            log, cwd=ROOT)
        try:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            tok = load_tokenizer(resolve(args.model))
            work = pydoc_workload(tok, args.num_requests, seed=args.seed,
                                  prompt_tokens=(32, 256), output_tokens=(16, 64))
            _live(args, server.url, model, work[:4])  # warm the path
            alone = _live(args, server.url, model, work)
            batch_work = pydoc_workload(tok, args.batch_lines, seed=args.seed + 7,
                                        prompt_tokens=(64, 384), output_tokens=(1, 1))
            up = client.files.create(file=("b.jsonl", _batch_file(batch_work, model,
                                                                  args.batch_max_tokens)),
                                     purpose="batch")
            batch = client.batches.create(input_file_id=up.id, endpoint="/v1/completions",
                                          completion_window="24h")
            while client.batches.retrieve(batch.id).status == "validating":
                time.sleep(0.1)
            time.sleep(1.0)  # its first lines admitted and decoding
            during = _live(args, server.url, model, work)
            after = client.batches.retrieve(batch.id)
            still_running = after.status == "in_progress"
            client.batches.cancel(batch.id)
            server.stop()
        finally:
            server.kill()
    ratio = during["ttft_s"]["p99"] / alone["ttft_s"]["p99"]
    print(json.dumps({
        "commit": provenance.commit(), "cpu": provenance.cpu(), "model": args.model,
        "interactive": {"requests": args.num_requests, "rate": args.request_rate,
                        "max_concurrency": args.max_concurrency},
        "batch": {"lines": args.batch_lines, "max_tokens": args.batch_max_tokens,
                  "concurrent_lines": args.batch_concurrency,
                  "lines_done_by_end_of_run": after.request_counts.completed,
                  "ran_through_the_whole_run": still_running},
        "alone": alone, "with_batch": during, "ttft_p99_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

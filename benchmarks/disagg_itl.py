"""Inter-token latency of short interactive streams while long prompts arrive: one colocated
`jaxserve serve` against a prefill server and a decode server (`serve --role prefill|decode`,
docs/disaggregation.md), the same seeded workload, the same run.

Each setup gets --num-short streaming requests (prompts of 32-128 tokens of Python's
documentation, --short-output tokens each, Poisson at --short-rate/s) and meanwhile --num-long
long prompts (--long-tokens each, 4 output tokens, Poisson at --long-rate/s). Prints one JSON
report: both setups' short-stream ITL and TTFT (p50, p99), the long prompts' TTFT, and
`itl_p99_ratio` (disaggregated over colocated; below 1.0: the split helps the streams), with
the machine (CPU model and SIMD flags). On one host both servers share its cores (or its one
device): what the split removes is the prefill chunks from the decode server's steps, not the
competition for compute, so a CPU host understates what two devices would show.

    python benchmarks/disagg_itl.py                       # SmolLM2, CPU defaults
    python benchmarks/disagg_itl.py --long-tokens 8000 --max-model-len 8192 --num-pages 1400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import socket
import sys
import tempfile
from pathlib import Path

import provenance  # benchmarks/ is the script's directory
import serving
from workload import pydoc_workload

ROOT = Path(__file__).resolve().parents[1]


async def _both(url: str, model: str, short, long, args):
    return await asyncio.gather(
        serving.run_load(url, model, short, args.short_rate, None, args.seed),
        serving.run_load(url, model, long, args.long_rate, None, args.seed + 1))


def _measure(url: str, short, long, warm, args) -> dict:
    serving_model = "bench"
    # Warm the path (the first connection, a page transfer) with prompts of their own: a warm-up
    # sending long[0] would make the measured long[0] a prefix-cache hit.
    asyncio.run(_both(url, serving_model, warm[:2], warm[2:], args))
    (s_res, s_sec), (l_res, l_sec) = asyncio.run(_both(url, serving_model, short, long, args))
    return {"short": serving.summarize(s_res, s_sec, short, slo_ttft=1.0, slo_tpot=0.1),
            "long": serving.summarize(l_res, l_sec, long, slo_ttft=60.0, slo_tpot=1.0)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from jaxserve.entrypoints.process import ServerProcess
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serving.add_engine_args(p)
    p.set_defaults(max_model_len=2304)
    p.add_argument("--num-short", type=int, default=16)
    p.add_argument("--short-rate", type=float, default=2.0)
    p.add_argument("--short-output", type=int, default=32)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-rate", type=float, default=0.5)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--offload-gib", type=float, default=0.5, help="each server's host KV tier")
    p.add_argument("--prefill-timeout", type=float, default=600.0,
                   help="the decode server's --prefill-timeout (an 8k-token prompt waits minutes "
                        "for its prefill on a CPU host)")
    p.add_argument("--decode-args", default="",
                   help="more flags for the decode server, e.g. '--max-local-prefill-length 256'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    commit = provenance.commit()  # before anything runs: the tree may change while it does
    tok = load_tokenizer(resolve(args.model))
    short = pydoc_workload(tok, args.num_short, seed=args.seed, prompt_tokens=(32, 128),
                           output_tokens=(args.short_output, args.short_output))
    long = pydoc_workload(tok, args.num_long, seed=args.seed + 1,
                          prompt_tokens=(args.long_tokens, args.long_tokens),
                          output_tokens=(4, 4))
    # Two short prompts and one of 512 tokens (32 full pages: the transfer runs), from a third seed.
    warm = (pydoc_workload(tok, 2, seed=args.seed + 2, prompt_tokens=(32, 128),
                           output_tokens=(4, 4))
            + pydoc_workload(tok, 1, seed=args.seed + 3, prompt_tokens=(512, 512),
                             output_tokens=(4, 4)))
    flags = serving.serve_flags(args) + ["--served-model-name", "bench",
                                         "--kv-offloading-size", str(args.offload_gib)]
    env = dict(os.environ, JAXSERVE_KV_TRANSFER_SECRET=secrets.token_hex(16))
    report = {"commit": commit, "cpu": provenance.cpu(), "model": args.model,
              "short": {"requests": args.num_short, "rate": args.short_rate,
                        "output_tokens": args.short_output},
              "long": {"requests": args.num_long, "rate": args.long_rate,
                       "prompt_tokens": args.long_tokens},
              "decode_args": args.decode_args,
              "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"{i}.log", "w") for i in range(3)]
        server = ServerProcess(flags, logs[0], cwd=ROOT)
        try:
            report["colocated"] = _measure(server.url, short, long, warm, args)
            server.stop()
        finally:
            server.kill()
        port = _free_port()
        prefill = ServerProcess(flags[:flags.index("--port")] + flags[flags.index("--port") + 2:]
                                + ["--port", str(port), "--role", "prefill"], logs[1],
                                cwd=ROOT, env=env)
        try:
            decode = ServerProcess(flags + ["--role", "decode", "--prefill-url",
                                            f"http://127.0.0.1:{port}", "--prefill-timeout",
                                            str(args.prefill_timeout),
                                            *shlex.split(args.decode_args)], logs[2], cwd=ROOT,
                                   env=env)
            try:
                report["disaggregated"] = _measure(decode.url, short, long, warm, args)
                decode.stop()
            finally:
                decode.kill()
            prefill.stop()
        finally:
            prefill.kill()
    report["load_average_at_end"] = os.getloadavg()
    report["itl_p99_ratio"] = (report["disaggregated"]["short"]["itl_s"]["p99"]
                               / report["colocated"]["short"]["itl_s"]["p99"])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

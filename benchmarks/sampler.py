"""The sampler on the CPU: one call of the compiled sampler over real SmolLM2 logits (the
throughput workload's prompts, 64 rows), per sampling setting; the CPU kernels' top-k/top-p
thresholds against the pure-JAX bisection in the same process, and, in a child process run the
same way, glibc's malloc defaults against the engine's settings (jaxserve/host_malloc.py).

    python benchmarks/sampler.py
    python benchmarks/sampler.py --rows 16 --no-malloc-baseline
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import subprocess
import sys
import time

import provenance  # benchmarks/ is the script's directory
from workload import pydoc_workload

SMOLLM2 = "smollm2-135m-instruct"
SETTINGS = {"greedy": dict(temperature=0.0), "temperature 0.8": dict(temperature=0.8),
            "top_p 0.95": dict(temperature=0.8, top_p=0.95),
            "top_k 50": dict(temperature=0.8, top_k=50),
            "top_k 50, top_p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9)}


def real_logits(model: str, rows: int):
    """[rows, vocab] f32 logits of real sampling rows: those the model gives the workload's
    prompts over their first two output tokens, through an engine built as the throughput
    benchmark builds it."""
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    work = pydoc_workload(load_tokenizer(resolve(model)), rows, seed=0, prompt_tokens=(16, 256),
                          output_tokens=(2, 3))
    llm = LLM(model, max_num_seqs=rows, max_num_batched_tokens=512, max_model_len=512,
              progress=False, warmup=False)
    runner, seen = llm.engine.runner, []
    sample = runner.sample

    def keep(logits, sampling_rows, *rest):
        seen.append(np.asarray(logits)[[i for i, r in enumerate(sampling_rows) if r is not None]])
        return sample(logits, sampling_rows, *rest)

    runner.sample = keep
    llm.generate([{"prompt_token_ids": p} for p, _ in work],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return llm, np.concatenate(seen)[:rows]


def time_sampler(llm, logits, params: dict, *, kernel: bool, repeats: int) -> float:
    """Best of `repeats` calls (tokens back on the host) of the sampler over `logits`, ms."""
    import jax

    from jaxserve import sampler
    from jaxserve.sampling import SamplingParams, SamplingRow

    rows = [SamplingRow(SamplingParams(**params, seed=i, max_tokens=None), i, [1], [])
            for i in range(logits.shape[0])]
    md = sampler.make_sampling_metadata(rows, logits.shape[0],
                                        eos_token_ids=llm.engine.runner.eos_token_ids)
    sample = jax.jit(functools.partial(sampler.sample, all_greedy=params["temperature"] == 0))
    available = sampler.cpu_sampling.available
    if not kernel:  # traced now, on the bisection path
        sampler.cpu_sampling.available = lambda: False
    try:
        jax.device_get(tuple(sample(logits, md)))
    finally:
        sampler.cpu_sampling.available = available
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.device_get(tuple(sample(logits, md)))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(args) -> dict:
    if args.malloc_defaults:
        from jaxserve import host_malloc
        host_malloc.keep_freed_memory = lambda: False  # before the engine sets them
    llm, logits = real_logits(args.model, args.rows)
    return {name: {path: time_sampler(llm, logits, params, kernel=path == "kernel",
                                      repeats=args.repeats) for path in ("kernel", "bisection")}
            for name, params in SETTINGS.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-malloc-baseline", dest="malloc_baseline", action="store_false",
                   help="skip the child process with glibc's malloc defaults")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="keep glibc's malloc defaults (what the child runs)")
    p.add_argument("--json", action="store_true", help="print the timings as JSON only")
    args = p.parse_args()

    times = measure(args)
    if args.json:
        print(json.dumps(times))
        return
    defaults = None
    if args.malloc_baseline:
        child = subprocess.run([sys.executable, __file__, "--model", args.model, "--rows",
                                str(args.rows), "--repeats", str(args.repeats),
                                "--malloc-defaults", "--json"],
                               capture_output=True, text=True, check=True)
        defaults = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"commit {provenance.commit()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {provenance.cpu()}")
    print(f"sampler over {args.rows} rows of {args.model} logits, ms per call (best of "
          f"{args.repeats})")
    header = "| setting | kernel | bisection | kernel / bisection |"
    if defaults:
        header += " kernel, glibc malloc defaults | engine settings / defaults |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for name, t in times.items():
        row = f"| {name} | {t['kernel']:.2f} | {t['bisection']:.2f} | " \
              f"{t['kernel'] / t['bisection']:.2f}x |"
        if defaults:
            d = defaults[name]["kernel"]
            row += f" {d:.2f} | {t['kernel'] / d:.2f}x |"
        print(row)


if __name__ == "__main__":
    main()

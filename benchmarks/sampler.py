"""The sampler on the CPU: one call of the compiled sampler over real SmolLM2 logits (the
throughput workload's prompts, 64 rows), per sampling setting, with the CPU kernels' top-k/top-p
thresholds (jaxserve.kernels.sampling) against the pure-JAX bisection, in the same process.

    python benchmarks/sampler.py
    python benchmarks/sampler.py --rows 16
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
    import jax
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
    return llm, jax.device_put(np.concatenate(seen)[:rows])  # on the device, as the engine's


def sampler_call(llm, logits, params: dict, *, kernel: bool):
    """A no-argument call of the sampler over `logits`, every row with these SamplingParams
    (seeded per row), traced on the kernel's path or the bisection's (the CPU kernels switched
    off while it traces); tokens back on the host."""
    import os

    import jax

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.executor import sampler
    from jaxserve.executor.sampling_rows import SamplingRow
    from jaxserve.kernels import cpu

    rows = [SamplingRow(SamplingParams(**params, seed=i, max_tokens=None), i, [1], [])
            for i in range(logits.shape[0])]
    md = jax.device_put(sampler.make_sampling_metadata(
        rows, logits.shape[0], eos_token_ids=llm.engine.runner.eos_token_ids))
    sample = jax.jit(functools.partial(sampler.sample, all_greedy=params["temperature"] == 0))
    switch = os.environ.get(cpu.ENV)
    if not kernel:  # traced now, on the bisection path
        cpu.set_mode("off")
    try:
        jax.device_get(tuple(sample(logits, md)))
    finally:
        if switch is None:
            os.environ.pop(cpu.ENV, None)
        else:
            os.environ[cpu.ENV] = switch
    return lambda: jax.device_get(tuple(sample(logits, md)))


def best_ms(calls: dict, repeats: int) -> dict:
    """Each call's best time in ms over `repeats` rounds, the calls alternated within a round."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    llm, logits = real_logits(args.model, args.rows)
    print(f"commit {provenance.commit()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {provenance.cpu()}")
    print(f"sampler over {args.rows} rows of {args.model} logits, ms per call (best of "
          f"{args.repeats}, the two paths alternated)")
    print("| setting | kernel | bisection | kernel / bisection |")
    print("|---|---|---|---|")
    for name, params in SETTINGS.items():
        t = best_ms({path: sampler_call(llm, logits, params, kernel=path == "kernel")
                     for path in ("kernel", "bisection")}, args.repeats)
        print(f"| {name} | {t['kernel']:.2f} | {t['bisection']:.2f} | "
              f"{t['kernel'] / t['bisection']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

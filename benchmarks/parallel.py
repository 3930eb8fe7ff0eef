"""Data and tensor parallelism: throughput of DP=2 vs DP=1 replicas of TP devices each, in the same
run on the same devices; and, on a GPU or TPU host, TP scaling (TP=1, 2, 4, ... devices).

On a CPU host the devices are virtual (`--xla_force_host_platform_device_count`, set here before
JAX starts): 2 x 4 of them by default, as the issue asks, sharing the host's cores. The workload is
benchmarks/workload.py's (seeded pydoc prompts, greedy, ignore_eos), submitted at once to the
engine a server would run (`jaxserve.core.engine_factory.start_engine`: an AsyncEngine, or a
ReplicaSet). With DP=2 every replica's step is timed: `overlap` is the share of the time some
replica steps during which both do (0: the replicas serialize; 1: they always step together).

    python benchmarks/parallel.py                     # DP=2 vs DP=1, TP=4, on 8 virtual CPU devices
    python benchmarks/parallel.py --tp-scaling        # on a GPU/TPU host: TP=1, 2, 4, ...
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # the virtual CPU devices must exist before JAX starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import asyncio  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from workload import pydoc_workload  # noqa: E402  (benchmarks/ is the script's directory)

SMOLLM2 = "smollm2-135m-instruct"


class StepTimes:
    """Wraps each replica's LLMEngine.step to record (start, end) of every step it runs."""

    def __init__(self, engines):
        self.intervals = [[] for _ in engines]
        self._lock = threading.Lock()
        for i, e in enumerate(engines):
            e.step = self._timed(i, e.step)

    def _timed(self, i, step):
        def timed():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                with self._lock:
                    self.intervals[i].append((t0, time.perf_counter()))
        return timed

    def overlap(self) -> float:
        """Time both replicas step / time at least one does (a sweep over interval endpoints)."""
        events = sorted((t, d) for iv in self.intervals for a, b in iv for t, d in ((a, 1),
                                                                                     (b, -1)))
        busy = both = 0.0
        depth, last = 0, None
        for t, d in events:
            if last is not None:
                busy += (t - last) if depth >= 1 else 0.0
                both += (t - last) if depth >= 2 else 0.0
            depth, last = depth + d, t
        return both / busy if busy else 0.0


async def _generate_all(engine, work) -> int:
    from jaxserve.core.sampling_params import SamplingParams

    async def one(prompt, n):
        last = None
        async for out in engine.generate({"prompt_token_ids": prompt},
                                         SamplingParams(temperature=0, max_tokens=n,
                                                        ignore_eos=True)):
            last = out
        return len(last.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(p, n) for p, n in work)))


def run(args, work, tp: int, dp: int) -> dict:
    from jaxserve.core.engine_factory import start_engine

    t0 = time.perf_counter()
    engine = start_engine(args.model, progress=False, tensor_parallel_size=tp,
                          data_parallel_size=dp, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=512)
    startup = time.perf_counter() - t0
    replicas = getattr(engine, "replicas", [engine])
    steps = StepTimes([r.engine for r in replicas])
    try:
        t0 = time.perf_counter()
        tokens = asyncio.run(_generate_all(engine, work))
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    assert tokens == sum(n for _, n in work)
    result = {"tp": tp, "dp": dp, "seconds": seconds, "startup_seconds": startup,
              "output_tok_s": tokens / seconds,
              "steps": [len(iv) for iv in steps.intervals]}
    if dp > 1:
        result["overlap"] = steps.overlap()
    print(f"TP={tp} DP={dp}: {seconds:6.1f} s, {result['output_tok_s']:6.1f} output tok/s, "
          f"steps per replica {result['steps']}"
          + (f", overlap {result['overlap']:.2f}" if dp > 1 else ""), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--tp", type=int, default=4, help="devices per replica (DP comparison)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--tp-scaling", action="store_true",
                   help="TP=1, 2, 4, ... up to the device count (meaningful on GPU/TPU only)")
    args = p.parse_args()

    import jax

    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    work = pydoc_workload(load_tokenizer(resolve(args.model)), args.num_requests, seed=0,
                          prompt_tokens=(16, 128), output_tokens=(16, 64))
    backend, devices = jax.default_backend(), jax.devices()
    print(f"workload: {len(work)} requests, {sum(len(q) for q, _ in work)} prompt + "
          f"{sum(n for _, n in work)} output tokens; {len(devices)} {backend} devices "
          f"({devices[0].device_kind}); host {platform.machine()}, {os.cpu_count()} cores",
          flush=True)
    results = {}
    if args.tp_scaling:
        if backend == "cpu":
            print("TP scaling: not measured: no GPU or TPU (virtual CPU devices share the same "
                  "cores, so TP cannot scale on them)")
        else:
            sizes = [n for n in (1, 2, 4, 8, 16) if n <= len(devices)]
            results["tp_scaling"] = [run(args, work, tp, 1) for tp in sizes]
            base = results["tp_scaling"][0]["output_tok_s"]
            for r in results["tp_scaling"]:
                print(f"TP={r['tp']}: {r['output_tok_s'] / base:.2f}x TP=1")
    else:
        one, two = run(args, work, args.tp, 1), run(args, work, args.tp, 2)
        results["dp"] = [one, two]
        print(f"DP=2 / DP=1 throughput (TP={args.tp}): "
              f"{two['output_tok_s'] / one['output_tok_s']:.2f}x; replicas stepping together "
              f"{two['overlap']:.0%} of the time")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Where one decode step's time goes (issue 42): the step of SmolLM2's GGUF through the blocks
kernel (or, `--quantization none`, the f32 load through the stacked f32 kernel), by default at one
sequence, itemized from a jax.profiler trace of XLA:CPU's thunks, and the step against a baseline
path rebuilt in the same process.

    python benchmarks/decode_step_profile.py [--rounds 3] [--repeats 10] [--baseline NAME ...]
    python benchmarks/decode_step_profile.py --num-seqs 64 [--quantization none]

The step is what serving runs for --num-seqs decoding sequences: the forward at that token
bucket (30 layers, the LM head on those rows), the greedy sampler, the tokens read on the host
(benchmarks/throughput.py's `greedy_step_seconds`' step), best of --repeats per round, in wall
time and in the process's CPU time. The trace's events are grouped:
- `gguf <shape>`: the quantized kernel's calls (jaxserve_quantized_matmul), by output shape;
- `f32 <shape>`: the f32 stacked-weights kernel's calls (jaxserve_stacked_matmul), by shape;
- `attention decode`, `kv write`: the attention custom call and the step's K/V written into
  the cache (the library's call, or XLA's scatter: its dynamic-update-slice, the guard that
  drops out-of-range slots and the copy XLA adds of the cache's buffer);
- `xla ops`: every other thunk (norms, rope, residual adds, silu * mul, embedding lookup, the
  sampler's program);
- `idle between ops`: the time in the step's op span that no op covers (the thunk executor,
  the while loop, thread hand-offs);
- `host: launch`, `host: sample + read`: from the forward's call to its first op, and from the
  step's last op (the sampler's) to the tokens on the host;
- the ops and the thread-pool tasks (XLA's partitioned fusions, the kernels' helpers) per step.

Baselines (`--baseline`, each a path the code took before, rebuilt here for an A/B in one
process, engines alternating per round):
- `xla-kv-write`: an f32 KV cache written by XLA's scatter instead of the library's call.

Prints the CPU, its flags and the load average with every figure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextlib.contextmanager
def xla_kv_write():
    """Build with the KV write through XLA's scatter (every dtype but bf16, as before)."""
    import jax.numpy as jnp

    from jaxserve.kernels import attention
    from jaxserve.kernels.attention import xla

    write = attention.write_kv

    def old(kv_cache, k, v, slot_mapping, *, impl="auto"):
        if kv_cache.dtype == jnp.float32:
            return xla.write_kv(kv_cache, k, v, slot_mapping)
        return write(kv_cache, k, v, slot_mapping, impl=impl)

    attention.write_kv = old
    try:
        yield
    finally:
        attention.write_kv = write


BASELINES = {"xla-kv-write": xla_kv_write}


def ffi_targets(hlo: str) -> dict[str, str]:
    """Each custom call's instruction name -> 'target shape' in the compiled HLO."""
    return {m.group(1): f"{m.group(3)} {m.group(2).split('{')[0]}" for m in re.finditer(
        r"%([\w.-]+) = (\S+) custom-call\(.*?custom_call_target=\"(\w+)\"", hlo)}


def group(name: str, targets: dict[str, str]) -> str:
    target = targets.get(name, "")
    if target.startswith("jaxserve_quantized_matmul"):
        return "gguf " + target.split()[1]
    if target.startswith("jaxserve_stacked_matmul"):
        return "f32 " + target.split()[1]
    if target.startswith("jaxserve_paged_decode"):
        return "attention decode"
    if target.startswith("jaxserve_write_kv") or "dynamic-update-slice" in name \
            or name.startswith(("copy.", "bitcast_dynamic-slice", "and_reduce")):
        return "kv write"
    return "xla ops"


def itemize(trace_dir: str, targets: dict[str, str]) -> list[dict]:
    """Per traced step: ms per group, and its ops and thread-pool tasks (counts)."""
    from jax._src.profiler import ProfileData

    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    events = []
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            thread = line.name.split("/")[0]
            events += [(thread, e.name, e.start_ns, e.start_ns + e.duration_ns)
                       for e in line.events]
    python = sorted((e for e in events if e[0] == "python"), key=lambda e: e[2])
    starts = [e for e in python if e[1].endswith(" run_forward")]
    ends = [e for e in python if e[1].endswith(" sample") and "runner.py" in e[1]]
    # XLA's own markers (the executor, a thread-pool task's start and end) are not ops: counted,
    # as the tasks the step hands to the pool, not timed.
    markers = ("ThunkExecutor", "ThreadpoolListener", "end:", "while")
    ops = [e for e in events if e[0] != "python" and not e[1].startswith(markers)]
    tasks = [e[2] for e in events if e[1] == "ThreadpoolListener::StartRegion"]
    steps = []
    for start, end in zip(starts, ends):
        t0, t1 = start[2], end[3]
        mine = sorted((e for e in ops if e[2] >= t0 and e[3] <= t1), key=lambda e: e[2])
        row = collections.Counter()
        row["ops (count)"] = len(mine)
        row["pool tasks (count)"] = sum(t0 <= t <= t1 for t in tasks)
        busy, span_start, span_end = 0, None, None
        for _, name, s, e in mine:
            row[group(name, targets)] += (e - s) / 1e6
            if span_end is None or s > span_end:
                busy += 0 if span_end is None else span_end - span_start
                span_start, span_end = s, e
            else:
                span_end = max(span_end, e)
        busy += span_end - span_start
        first, last = mine[0][2], mine[-1][3]
        row["idle between ops"] = (last - first - busy) / 1e6
        row["host: launch"] = (first - t0) / 1e6
        row["host: sample + read"] = (t1 - last) / 1e6
        row["step (traced)"] = (t1 - t0) / 1e6
        steps.append(row)
    return steps


def step_seconds(runner, rows, repeats: int) -> tuple[float, float]:
    """Best of `repeats` decode steps of len(rows) sequences (throughput.greedy_step_seconds'
    step), in wall time and in the process's CPU time (both threads; on a loaded host the CPU time
    is the steadier figure: it does not count the time the step waited for a core)."""
    from throughput import decode_plan

    plan, _ = decode_plan(runner.shapes, len(rows))
    runner.sample(runner.forward(plan), rows)
    wall = cpu = float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        runner.sample(runner.forward(plan), rows)  # returns host arrays: the step is done
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="gguf",
                    help="gguf, int8 (the int8 storage), or none: the f32 load")
    ap.add_argument("--num-seqs", type=int, default=1, help="decoding sequences in the step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--traced-steps", type=int, default=10)
    ap.add_argument("--baseline", nargs="*", default=[], choices=sorted(BASELINES))
    args = ap.parse_args()
    import jax
    from gguf_in_place import cpu_line
    from throughput import decode_plan

    from jaxserve import LLM
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.executor.sampling_rows import SamplingRow

    print(f"cpu: {cpu_line()}; load average at start {os.getloadavg()}", flush=True)
    # The forward compiled for a token bucket of --num-seqs (1: as serving runs a lone decode).
    n = args.num_seqs
    kw = dict(quantization=args.quantization,
              max_num_seqs=n, max_num_batched_tokens=n, max_model_len=512, num_pages=40 * n,
              progress=False)
    llms = {}
    for name in args.baseline:
        with BASELINES[name]():
            llms[name] = LLM(args.model, **kw)
    llms["current"] = LLM(args.model, **kw)
    print(f"engines built; load average {os.getloadavg()}", flush=True)

    rows = [SamplingRow(SamplingParams(temperature=0, max_tokens=None), 0, [1], [])] * n
    wall, cpu = dict.fromkeys(llms, float("inf")), dict.fromkeys(llms, float("inf"))
    for r in range(args.rounds):
        for name, llm in llms.items():
            w, c = step_seconds(llm.engine.runner, rows, args.repeats)
            wall[name], cpu[name] = min(wall[name], w), min(cpu[name], c)
        print(f"round {r + 1}, best so far (wall / process CPU): " + ", ".join(
            f"{n} {wall[n] * 1e3:.2f} / {cpu[n] * 1e3:.2f} ms" for n in llms)
            + f"; load average {os.getloadavg()}", flush=True)
    for name in args.baseline:
        print(f"step, {name} -> current: wall {wall[name] * 1e3:.2f} -> "
              f"{wall['current'] * 1e3:.2f} ms ({wall[name] / wall['current']:.3f}x), process CPU "
              f"{cpu[name] * 1e3:.2f} -> {cpu['current'] * 1e3:.2f} ms "
              f"({cpu[name] / cpu['current']:.3f}x)")

    for name, llm in llms.items():
        runner = llm.engine.runner
        plan, _ = decode_plan(runner.shapes, n)
        targets = ffi_targets(runner._programs[("forward", n)].as_text())
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            for _ in range(args.traced_steps):
                runner.sample(runner.forward(plan), rows)
            jax.profiler.stop_trace()
            steps = itemize(trace_dir, targets)
        # The fastest traced step: the one the load disturbed least.
        quiet = min(steps, key=lambda s: s["step (traced)"])
        median = {k: sorted(s[k] for s in steps)[len(steps) // 2] for k in quiet}
        print(f"\n{name}: ms in the fastest traced step / the median of {len(steps)} (load "
              f"average {os.getloadavg()}):")
        for key in sorted(quiet, key=lambda k: ("count" in k, -median[k])):
            print(f"  {key:24s} {quiet[key]:8.3f} {median[key]:8.3f}")


if __name__ == "__main__":
    main()

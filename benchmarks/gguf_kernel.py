"""The GGUF kernel alone (issue 42): SmolLM2's projections in their GGUF formats through
jaxserve/kernels/cpu/quantized_matmul.cc at a few rows, x rounded to int8 per block (integer dot
products: `--gguf-dot int8`, up to INT8_DOT_MAX_ROWS rows) against x kept f32 (each weight widened
to f32: `--gguf-dot f32`, the default), the two alternating in one process.

    python benchmarks/gguf_kernel.py [--rows 1,4] [--rounds 5] [--repeats 20]

Each shape is a stack of 30 layers (the model's count) of random valid blocks, and one timed call
runs all 30 in a scan, so the blocks stream from memory as in a decode step rather than from
cache (the LM head is one 49,152-row Q8_0 matrix, 30 MB). Prints each shape's time per layer,
the blocks' GB/s and the ratio int8 / f32 (best of --repeats per round, best over rounds), and a
step's total over every shape (30 layers' projections + the head), with the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYERS = 30
# name, format, K, the N of each weight in one call (decoder._project_together's groups).
SHAPES = [
    ("q, k, v", "q4_1", 576, (576, 192, 192), LAYERS),
    ("o", "q4_1", 576, (576,), LAYERS),
    ("gate, up", "q4_1", 576, (1536, 1536), LAYERS),
    ("down", "q4_1", 1536, (576,), LAYERS),
    ("LM head", "q8_0", 576, (49152,), 1),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gguf_in_place import cpu_line
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.kernels import matmul

    assert cpu_kernels.enabled(), cpu_kernels.why_off()
    print(f"cpu: {cpu_line()}; load average at start {os.getloadavg()}", flush=True)
    key = jax.random.key(0)
    stacks = {}
    for name, fmt, k, ns, layers in SHAPES:
        ws = []
        for n in ns:
            key, sub = jax.random.split(key)
            keys = jax.random.split(sub, layers)
            ws.append(jnp.stack([matmul.random_blocks(kk, n, k, fmt, 0.05) for kk in keys]))
        stacks[name] = ws

    def program(fmt, layers, int8_dot):
        def run(x, ws):
            def body(carry, layer):
                out = matmul.quantized_matmul(x, ws, layer, fmt, int8_dot)
                return carry + out[:, :1], None  # a dependency on every call
            return jax.lax.scan(body, jnp.zeros((x.shape[0], 1)), jnp.arange(layers))[0]
        return jax.jit(run)

    rows = [int(r) for r in args.rows.split(",")]
    modes = ("int8", "f32")
    best = {}
    calls = {}
    for name, fmt, k, ns, layers in SHAPES:
        for t in rows:
            x = jax.random.normal(jax.random.key(t), (t, k), jnp.float32)
            for mode in modes:
                f = program(fmt, layers, mode == "int8")
                jax.block_until_ready(f(x, stacks[name]))
                calls[name, t, mode] = (f, x)
                best[name, t, mode] = float("inf")
    for r in range(args.rounds):
        for name, fmt, k, ns, layers in SHAPES:
            for t in rows:
                for mode in modes:
                    f, x = calls[name, t, mode]
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(x, stacks[name]))
                        best[name, t, mode] = min(best[name, t, mode],
                                                  (time.perf_counter() - t0) / layers)
        print(f"round {r + 1} done; load average {os.getloadavg()}", flush=True)
    for t in rows:
        total = dict.fromkeys(modes, 0.0)
        for name, fmt, k, ns, layers in SHAPES:
            nbytes = sum(matmul.row_bytes(fmt, k) * n for n in ns)
            line = []
            for mode in modes:
                s = best[name, t, mode]
                total[mode] += s * (LAYERS if layers == LAYERS else 1)
                line.append(f"{mode} {s * 1e6:.1f} us ({nbytes / s / 1e9:.1f} GB/s)")
            print(f"{t} row(s), {name} ({fmt}, K {k}, N {'+'.join(map(str, ns))}): "
                  f"{', '.join(line)}; int8 {best[name, t, 'f32'] / best[name, t, 'int8']:.2f}x")
        print(f"{t} row(s), a step's projections and head: int8 {total['int8'] * 1e3:.2f} ms, "
              f"f32 {total['f32'] * 1e3:.2f} ms: {total['f32'] / total['int8']:.2f}x")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()

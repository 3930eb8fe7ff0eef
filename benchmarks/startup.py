"""Start-up time: `jaxserve serve` cold (an empty persistent compilation cache) vs warm (the cache
the cold start filled), and how long SmolLM2's weights take to load from each format.

    python benchmarks/startup.py [--model smollm2-135m-instruct] [--skip-formats]

Each serve start is timed from launching the process to its "serving" line, and the server's own
"ready in" line splits it into load and compile. Warm is reported as a fraction of cold from the
same run. The weight formats are the registered GGUF, its orbax conversion (`jaxserve convert`)
and an HF safetensors directory written from the same tensors (f32); each is loaded onto the
device twice in this process and the faster time is kept.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"


def serve_once(model: str, cache_dir: Path) -> dict:
    """Start, wait for the serving line, stop; the times it took."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", model, "--port", "0",
         "--no-rag", "--compile-cache-dir", str(cache_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = None
    try:
        for line in proc.stdout:
            if line.startswith("jaxserve: ready in "):
                ready = line.strip()
            if line.startswith("jaxserve: serving "):
                wall = time.perf_counter() - started
                break
        else:
            raise RuntimeError(f"serve exited with {proc.wait()} before serving")
    finally:
        proc.terminate()
        proc.wait(60)
    # "jaxserve: ready in T s (load L s, compile C s)"
    numbers = [float(w) for w in ready.replace("(", " ").replace(",", " ").split()
               if w.replace(".", "", 1).isdigit()]
    return {"wall_s": wall, "ready_s": numbers[0], "load_s": numbers[1], "compile_s": numbers[2]}


def load_seconds(spec) -> float:
    import jax

    from jaxserve.weights import load_model

    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        _, params = load_model(spec, "float32")
        jax.block_until_ready(params)
        best = min(best, time.perf_counter() - t0)
        del params
    return best


def weight_formats(model: str, tmp: Path) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from jaxserve.model_registry import ModelSpec, resolve
    from jaxserve.tokenizer import tokenizer_source
    from jaxserve.weights import load_host
    from jaxserve.weights.checkpoint import save_checkpoint
    from tests.test_weights import write_hf_dir  # our tree -> HF names and layout

    gguf = resolve(model)
    config, host = load_host(gguf, "float32")
    save_checkpoint(tmp / "orbax", config, host, tokenizer_source(gguf))
    write_hf_dir(tmp / "hf", config, host, shards=1)
    del host
    return {"gguf (Q4_1, dequantized)": load_seconds(gguf),
            "safetensors (f32)": load_seconds(ModelSpec(model, "hf", tmp / "hf")),
            "orbax (f32)": load_seconds(ModelSpec(model, "orbax", tmp / "orbax"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--skip-formats", action="store_true")
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}; {args.model}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cold = serve_once(args.model, tmp / "xla")
        warm = serve_once(args.model, tmp / "xla")
        print("| start | process to serving (s) | ready (s) | load (s) | compile (s) |")
        print("|---|---|---|---|---|")
        for name, r in (("cold (empty cache)", cold), ("warm (cache filled)", warm)):
            print(f"| {name} | {r['wall_s']:.1f} | {r['ready_s']:.1f} | {r['load_s']:.2f} | "
                  f"{r['compile_s']:.1f} |")
        print(f"warm / cold: {warm['wall_s'] / cold['wall_s']:.2f} (process to serving), "
              f"compile {warm['compile_s'] / cold['compile_s']:.2f}")
        if not args.skip_formats:
            times = weight_formats(args.model, tmp)
            base = times["gguf (Q4_1, dequantized)"]
            print("| format | load to device (s) | vs GGUF |")
            print("|---|---|---|")
            for name, s in times.items():
                print(f"| {name} | {s:.2f} | {s / base:.2f}x |")


if __name__ == "__main__":
    main()

"""Warm standby: waking a sleeping version against a cold start of the same model, one run.

    python benchmarks/warm_standby.py [--model smollm2-135m-instruct]

Three `jaxserve serve` starts and two wakes, each timed to the first answer (one greedy
completion of 16 tokens), so every row ends at the same point:
- cold: an empty persistent compilation cache (a new node);
- cold, cache filled: a restart that finds every program in the compilation cache (the best a
  scale-out by a new process can do);
- wake from level 1 (KV cache freed) and level 2 (weights in host memory too): POST /sleep on the
  running server, then POST /wake_up and the same completion, timed from the wake call.
Times are wall clock on this machine; the script prints the CPU, its SIMD flags and the load
average before and after (a loaded machine slows the cold starts most: they compile).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
KEY = "warm-standby-bench"
SIMD = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "neon", "sve")


def cpu() -> str:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine()):
                name = line.split(":", 1)[1].strip()
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs, flags: {' '.join(f for f in SIMD if f in flags)}"


def call(method: str, url: str, body: dict | None = None, key: str | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read() or b"{}")


def first_answer(url: str, model: str) -> str:
    out = call("POST", f"{url}/v1/completions", {
        "model": model, "prompt": "The capital of France is", "max_tokens": 16,
        "temperature": 0, "ignore_eos": True})
    return out["choices"][0]["text"]


class Server:
    """`jaxserve serve` in a child process, up to its serving line."""

    def __init__(self, model: str, cache_dir: Path, key_file: Path, settings: list[str]):
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve", "serve", "--model", model, "--port", "0",
             "--no-rag", "--compile-cache-dir", str(cache_dir), "--admin-key-file",
             str(key_file), *settings],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if line.startswith("jaxserve: serving "):  # "... at http://HOST:PORT/v1"
                self.url = line.split()[-1].removesuffix("/v1")
                break
        else:
            raise RuntimeError(f"serve exited with {self.proc.wait()} before serving")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--settings", default="--max-num-seqs 8 --max-model-len 512",
                   help="engine flags of every start (default: %(default)s)")
    args = p.parse_args()
    print(f"machine: {cpu()}; Python {platform.python_version()}; {args.model}")
    print(f"load average at the start: {os.getloadavg()}")
    rows, answers = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        key_file = tmp / "key"
        key_file.write_text(KEY)
        settings = args.settings.split()
        server = Server(args.model, tmp / "xla", key_file, settings)
        answers.append(first_answer(server.url, args.model))
        rows.append(("cold (empty compilation cache)", time.perf_counter() - server.started, None))
        server.stop()
        server = Server(args.model, tmp / "xla", key_file, settings)
        answers.append(first_answer(server.url, args.model))
        rows.append(("cold (compilation cache filled)", time.perf_counter() - server.started,
                     None))
        try:
            for level in (1, 2):
                t0 = time.perf_counter()
                state = call("POST", f"{server.url}/sleep?level={level}", key=KEY)
                slept = time.perf_counter() - t0
                assert state["is_sleeping"], state
                t0 = time.perf_counter()
                assert not call("POST", f"{server.url}/wake_up", key=KEY)["is_sleeping"]
                answers.append(first_answer(server.url, args.model))
                rows.append((f"wake from level {level} ({', '.join(state['sleeping'])})",
                             time.perf_counter() - t0, slept))
        finally:
            server.stop()
    print(f"load average at the end: {os.getloadavg()}")
    assert all(a == answers[0] for a in answers), answers  # the same greedy answer every time
    cold = rows[0][1]
    print("| start | to the first answer (s) | vs cold | sleep call (s) |")
    print("|---|---|---|---|")
    for name, seconds, slept in rows:
        print(f"| {name} | {seconds:.2f} | {seconds / cold:.3f} | "
              f"{'' if slept is None else f'{slept:.2f}'} |")


if __name__ == "__main__":
    main()

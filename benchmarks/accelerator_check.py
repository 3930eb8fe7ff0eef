"""The whole engine on whatever backend JAX finds, in one bounded run: the check a short lease of an
accelerator is spent on (issue 41), rehearsed on the CPU by the suite.

    python benchmarks/accelerator_check.py --out DIR [--budget-s 420] [--golden-dir DIR]

Steps, most important first; a step whose estimate does not fit in what is left of the budget is
skipped and says so, and a watchdog writes the report and exits when the budget runs out mid-step:
1. golden: SmolLM2's greedy cases through `LLM` (16-token chunked prefill, prefix cache on, the
   cases run twice so the second pass hits the cache), SmolLM2's tokenizer cases and MiniLM's
   embeddings (`../shared/golden`), each token-identical or a diff naming the first difference. On
   an accelerator the float32 cases run as users run them; a failure is rerun at the highest matmul
   precision to tell reduced-precision matmuls (TF32) from a wrong kernel.
2. kernel check: every attention implementation of this backend, compiled (not interpreted),
   against the float64 oracle (benchmarks/kernels.py's cases).
3. kernel bandwidth: the backend's decode kernel on 64 sequences x 2k tokens of context, in
   SmolLM2's head shape and an 8B-class one, as a fraction of the copy bandwidth measured here,
   with a few block and split-KV settings tried on a GPU.
4. roofline: decode at batch 1, 16 and 64 and prefill through the engine's compiled step
   (benchmarks/roofline.py) on SmolLM2 and a random-weight 1B Llama: tokens/s and the fraction of
   the roofline (weights + KV bytes over the measured bandwidth, or FLOPs over the measured matmul
   peak), and the host's share of each step (synchronous step minus back-to-back forwards).
5. engine decode: LLM.generate at batch 1 and 16 (SmolLM2), tokens/s end to end and the time
   between steps beyond the compiled step's.
6. tests: the engine and kernel test modules that make sense on this backend, each in a verbose
   pytest bounded by its share of what is left.
7. profile: a Perfetto trace of the random 1B Llama's decode step at batch 1 (DIR/decode_trace.json.gz).
It writes DIR/accelerator_check.json (top-level "golden": {"passed", "total"}, one entry per figure
in "figures") and DIR/accelerator_check.md after every step. It installs nothing: what a machine
with JAX and PyTorch lacks is in benchmarks/accelerator_wheels.txt (`make accelerator-bundle`).
Weights come from the model cache (JAXSERVE_CACHE); a model that is not there is skipped, named.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# Before JAX starts: take device memory as needed, so the test subprocess finds some left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]

import jax  # noqa: E402
import numpy as np  # noqa: E402

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"
TEST_MODULES = {  # engine and kernel tests; on the CPU the suite itself runs them all
    "accelerator": ["tests/test_ragged_paged_attention.py", "tests/test_sampler.py",
                    "tests/test_batch_plan.py", "tests/test_llama.py", "tests/test_engine.py"],
    "cpu": ["tests/test_batch_plan.py"],
}
# Seconds each step needs at least, by backend kind: a step that does not fit is skipped.
ESTIMATES = {
    "golden": {"accelerator": 90, "cpu": 40},
    "kernel check": {"accelerator": 40, "cpu": 300},  # the suite checks the CPU's kernels
    "kernel bandwidth": {"accelerator": 40, "cpu": 10},
    "roofline smollm2": {"accelerator": 45, "cpu": 20},
    "roofline llama-1b": {"accelerator": 60, "cpu": 240},
    "engine decode": {"accelerator": 45, "cpu": 30},
    "tests": {"accelerator": 60, "cpu": 15},
    "profile": {"accelerator": 40, "cpu": 120},
}


class Report:
    """What the check found so far, written to DIR after every step."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "budget_s": budget_s, "golden": {"passed": 0, "total": 0, "cases": []},
                           "figures": [], "steps": [], "tests": {}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def golden(self, name: str, diff: str | None) -> None:
        g = self.data["golden"]
        g["total"] += 1
        g["passed"] += diff is None
        g["cases"].append({"name": name, "passed": diff is None, **({"diff": diff} if diff else {})})
        print(f"golden {name}: {'ok' if diff is None else diff}", flush=True)

    def figure(self, name: str, value: float | None = None, unit: str = "", **extra) -> None:
        entry = {"name": name, "value": value, "unit": unit, **extra}
        self.data["figures"].append(entry)
        shown = "skipped: " + extra["skipped"] if value is None else f"{value:.4g} {unit}"
        print(f"figure {name}: {shown}", flush=True)

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "accelerator_check.json").write_text(json.dumps(self.data, indent=1))
            (self.out / "accelerator_check.md").write_text(markdown(self.data))


def markdown(d: dict) -> str:
    g = d["golden"]
    lines = [f"# Accelerator check: {d.get('device', '?')}", "",
             f"{d.get('versions', '')}; started {d['started']}, {d['elapsed_s']} s of a "
             f"{d['budget_s']:.0f} s budget.", "",
             f"**Golden: {g['passed']} / {g['total']} token-identical.**", ""]
    lines += [f"- {c['name']}: {c['diff']}" for c in g["cases"] if not c["passed"]]
    lines += ["", "| figure | value | of roofline / peak | notes |", "|---|---|---|---|"]
    for f in d["figures"]:
        if f["value"] is None:
            lines.append(f"| {f['name']} | skipped | | {f['skipped']} |")
            continue
        frac = f.get("fraction")
        notes = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in f.items()
                          if k not in ("name", "value", "unit", "fraction"))
        lines.append(f"| {f['name']} | {f['value']:.4g} {f['unit']} | "
                     f"{'' if frac is None else f'{frac:.0%}'} | {notes} |")
    lines += ["", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} |" for s in d["steps"]]
    t = d["tests"]
    if t:
        lines += ["", f"Tests: {t.get('summary', '')}"]
        lines += [f"- failed: {n}" for n in t.get("failed", [])]
    return "\n".join(lines) + "\n"


def first_difference(got: list, want: list) -> str | None:
    if got == want:
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"first difference at token {i} of {len(want)}: got {got[i:i + 4]}, "
            f"want {want[i:i + 4]}")


# ---- 1. golden ------------------------------------------------------------------------------------

def in_cache(model: str) -> bool:
    from jaxserve.model_registry import resolve

    try:
        resolve(model)
    except Exception:
        return False
    return True


def golden_smollm2(report: Report, golden_dir: Path, precision: str | None = None) -> list[str]:
    """The greedy cases, chunked, then again from the prefix cache; the names of failed cases."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    golden = json.loads((golden_dir / "smollm2_golden.json").read_text())
    cases = golden["cases"]
    label = f" (matmul precision {precision})" if precision else ""
    with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        llm = LLM(SMOLLM2, dtype="float32", num_pages=128, max_num_seqs=8,
                  max_num_batched_tokens=16, max_model_len=512, enable_prefix_caching=True,
                  warmup=False, progress=False)
        greedy = SamplingParams(temperature=0, max_tokens=golden["max_new_tokens"])
        failed = []
        for run in ("chunked", "prefix-cached"):
            outs = llm.generate([{"prompt_token_ids": c["input_ids"]} for c in cases], greedy)
            for k, (out, case) in enumerate(zip(outs, cases)):
                comp = out.outputs[0]
                diff = first_difference(comp.token_ids, case["greedy_ids"])
                if diff is None and comp.text != case["greedy_text"].replace("<|im_end|>", ""):
                    diff = f"same tokens, text differs: {comp.text[:60]!r}"
                name = f"smollm2 case {k} {run}{label}"
                report.golden(name, diff)
                if diff:
                    failed.append(name)
        stats = llm.engine.stats()
        report.data["golden"]["prefix_cache"] = (f"{stats.prefix_cache_hits} of "
                                                 f"{stats.prefix_cache_queries} prompt tokens hit")
        llm.engine.close()
    return failed


def golden_tokenizer(report: Report, golden_dir: Path) -> None:
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve(SMOLLM2))
    for k, case in enumerate(json.loads((golden_dir / "smollm2_tokenizer_golden.json")
                                        .read_text())):
        ids = tok.encode(case["text"])
        diff = first_difference(ids, case["ids"])
        if diff is None and tok.decode(ids, skip_special_tokens=False) != case["text"]:
            diff = "same ids, decoded text differs"
        report.golden(f"smollm2 tokenizer case {k}", diff)


def golden_minilm(report: Report, golden_dir: Path) -> None:
    from jaxserve.rag.config import EmbedderConfig
    from jaxserve.rag.embedder import Embedder

    golden = json.loads((golden_dir / "minilm_embedding_golden.json").read_text())
    embedder = Embedder.load(EmbedderConfig())
    ids = embedder.tokenize(golden["sentences"])
    report.golden("minilm token ids", first_difference(ids, golden["input_ids"]))
    vectors, _ = embedder.embed(golden["sentences"])
    err = float(np.abs(vectors - np.asarray(golden["embeddings"])).max())
    report.golden("minilm embeddings (max abs error <= 1e-4)",
                  None if err <= 1e-4 else f"max abs error {err:.2e} > 1e-4")


def step_golden(report: Report, args) -> None:
    if not (args.golden_dir / "smollm2_golden.json").exists():
        report.data["golden"]["skipped"] = f"no golden outputs in {args.golden_dir}"
        return
    if not in_cache(SMOLLM2):
        report.data["golden"]["skipped"] = f"{SMOLLM2} is not in the model cache"
        return
    golden_tokenizer(report, args.golden_dir)
    failed = golden_smollm2(report, args.golden_dir)
    if failed and jax.default_backend() != "cpu" and report.left() > ESTIMATES["golden"][
            "accelerator"]:
        report.data["golden"]["rerun_at_highest_precision"] = True
        golden_smollm2(report, args.golden_dir, precision="highest")
    if in_cache(MINILM):
        golden_minilm(report, args.golden_dir)
    else:
        report.data["golden"]["minilm"] = f"skipped: {MINILM} is not in the model cache"


# ---- 2-3. kernels ----------------------------------------------------------------------------------

def kernel_impls() -> list[str]:
    backend = jax.default_backend()
    return {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(backend, ["cpu"])


def step_kernel_check(report: Report, args) -> None:
    import kernels

    ok = kernels.check(kernel_impls())
    report.golden(f"attention kernels {kernel_impls()} + xla vs the float64 oracle",
                  None if ok else "a case exceeded its tolerance (see the log)")


def step_kernel_bandwidth(report: Report, args) -> None:
    import functools
    import itertools

    import jax.numpy as jnp
    import kernels

    from jaxserve.kernels import attention as rpa

    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if args.accelerator else jnp.float32
    rng = np.random.default_rng(0)
    q_lens, kv_lens = [1] * 64, [2048] * 64
    for label, (hq, hkv, d) in {"SmolLM2 heads 9/3x64": (9, 3, 64),
                                "8B-class heads 32/8x128": (32, 8, 128)}.items():
        batch = kernels.make_batch(rng, q_lens=q_lens, kv_lens=kv_lens, Hq=hq, Hkv=hkv, D=d,
                                   page_size=16, dtype=dtype)
        nbytes, _ = kernels.work(q_lens, kv_lens, hq, hkv, d, jnp.dtype(dtype).itemsize)
        configs = {impl: functools.partial(rpa.ragged_paged_attention, impl=impl,
                                           sm_scale=d ** -0.5)
                   for impl in ["xla", *kernel_impls()]}
        if on_gpu:  # a few settings around the defaults: what the 75% target should tune
            from jaxserve.kernels.attention import gpu

            kv_block = max(16, gpu.KV_TILE_BYTES // (d * jnp.dtype(dtype).itemsize))
            for rows, splits, block in itertools.product((16, 64), (None, 2, 8),
                                                         (kv_block, 2 * kv_block)):
                configs[f"pallas_gpu tile_rows={rows} num_splits={splits or 'auto'} "
                        f"kv_block_tokens={block}"] = functools.partial(
                    gpu.ragged_paged_attention, sm_scale=d ** -0.5, tile_rows=rows,
                    num_splits=splits, kv_block_tokens=block)
        for name, fn in configs.items():
            try:
                t = kernels.timeit(jax.jit(fn), *batch, iters=20 if args.accelerator else 3)
            except Exception as e:  # a setting this device cannot compile: say so, go on
                report.figure(f"decode attention 64 x 2k, {label}, {name}",
                              skipped=f"{type(e).__name__}: {str(e)[:160]}")
                continue
            report.figure(f"decode attention 64 x 2k, {label}, {name}", nbytes / t / 1e9,
                          "GB/s", fraction=nbytes / t / args.copy_bw, ms=t * 1e3,
                          dtype=jnp.dtype(dtype).name)


# ---- 4-5. the engine's step ------------------------------------------------------------------------

def step_roofline(model: str):
    def run(report: Report, args) -> None:
        import roofline

        if model == "smollm2" and not in_cache(SMOLLM2):
            report.figure(f"roofline {model}", skipped=f"{SMOLLM2} is not in the model cache")
            return
        ns = argparse.Namespace(dtype=args.dtype, context=args.context, batches=args.batches,
                                prefill_seqs=args.prefill_seqs,
                                prefill_tokens=args.prefill_tokens, repeats=args.repeats)
        for r in roofline.run_model(model, ns, args.copy_bw, args.matmul_peak):
            report.figure(f"{model} {r['dtype']} {r['batch']}", r["step_tok_s"], "tok/s",
                          fraction=r["step_of_roofline"], step_ms=r["step_ms"],
                          device_ms=r["queued_ms"], host_ms=r["step_ms"] - r["queued_ms"],
                          floor_ms=r["floor_ms"], bound=r["bound"],
                          weight_gb=r["weight_gb"])
    return run


def step_engine_decode(report: Report, args) -> None:
    """Decode through LLM.generate: the scheduler, the step and the detokenizer, end to end."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    if not in_cache(SMOLLM2):
        report.figure("engine decode smollm2", skipped=f"{SMOLLM2} is not in the model cache")
        return
    tokens = args.engine_tokens
    llm = LLM(SMOLLM2, dtype=args.dtype, num_pages=64 * (tokens // 16 + 4), max_num_seqs=64,
              max_num_batched_tokens=256, max_model_len=tokens + 64, warmup=False,
              progress=False)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for batch in args.engine_batches:
        prompts = [{"prompt_token_ids": [1, 4093, 198, 20 + i]} for i in range(batch)]
        # Compiles this batch's programs (no warm-up at start: only what is timed is compiled).
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        report.figure(f"engine decode smollm2 {args.dtype} batch {batch} ({tokens} tokens each, "
                      f"LLM.generate)", made / wall, "tok/s", ms_per_step=wall / tokens * 1e3)
    llm.engine.close()


# ---- 6. tests ----------------------------------------------------------------------------------

def step_tests(report: Report, args) -> None:
    """Each module in its own pytest, verbose, within an even share of what is left: a module
    that runs out of time still reports the tests it finished."""
    modules = [m for m in args.tests if (REPO / m).exists()]
    env = dict(os.environ, JAXSERVE_GOLDEN_DIR=str(args.golden_dir), PYTHONUNBUFFERED="1")
    results = report.data["tests"] = {"modules": modules, "by_module": {}, "failed": []}
    for k, module in enumerate(modules):
        share = (report.left() - 15) / (len(modules) - k)
        if share < 20:
            results["by_module"][module] = "skipped: the budget ran out"
            continue
        cmd = [sys.executable, "-m", "pytest", "-v", "-rf", "-p", "no:cacheprovider",
               "--timeout", str(int(min(share, 300))), module]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=share)
            out, status = (proc.stdout + proc.stderr).decode(), f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            out, status = (e.stdout or b"").decode(), f"stopped after {share:.0f} s"
        outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL)", out, re.M)
        counts = {o: sum(1 for _, x in outcomes if x == o) for o in ("PASSED", "FAILED",
                                                                     "ERROR", "SKIPPED")}
        results["by_module"][module] = f"{status}: " + ", ".join(
            f"{n} {o.lower()}" for o, n in counts.items() if n)
        results["failed"] += [t for t, o in outcomes if o in ("FAILED", "ERROR")]
        if not outcomes:
            results.setdefault("tails", {})[module] = out[-2000:]
        print(f"tests {module}: {results['by_module'][module]}", flush=True)
    results["summary"] = "; ".join(f"{m}: {r}" for m, r in results["by_module"].items())


def step_profile(report: Report, args) -> None:
    """A trace of a few decode steps of the random 1B Llama at batch 1 (Perfetto JSON in DIR):
    where the device time goes, kernel by kernel."""
    import glob
    import shutil

    import roofline
    from throughput import greedy_step_seconds, step_plan

    ns = argparse.Namespace(dtype=args.dtype, context=args.context, prefill_tokens=16,
                            prefill_seqs=1)
    config, params = roofline.load("llama-1b", args.dtype)
    runner = roofline.make_runner(config, params, ns, num_seqs=1, max_tokens=64)
    plan = step_plan(runner.shapes, [[1]], [args.context])
    greedy_step_seconds(runner, plan, 1, 2)
    trace_dir = args.out / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        greedy_step_seconds(runner, plan, 1, 3)
    found = glob.glob(str(trace_dir / "**" / "*perfetto_trace.json.gz"), recursive=True)
    if found:
        shutil.copy(found[0], args.out / "decode_trace.json.gz")
        report.data["profile"] = "decode_trace.json.gz: llama-1b decode, batch 1, 4 steps"
    shutil.rmtree(trace_dir, ignore_errors=True)
    runner.close()


# ---- main -----------------------------------------------------------------------------------------

def device_facts(args) -> dict:
    import kernels

    dev = jax.devices()[0]
    facts = {"device": dev.device_kind, "backend": jax.default_backend(),
             "versions": f"JAX {jax.__version__}, Python {platform.python_version()}",
             "host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            facts["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    args.copy_bw, args.matmul_peak = kernels.measure_peaks(args.accelerator, dtype=args.dtype)
    facts.update(copy_gb_s=round(args.copy_bw / 1e9, 1),
                 matmul_tflop_s=round(args.matmul_peak / 1e12, 2), matmul_dtype=args.dtype)
    return facts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--golden-dir", type=Path,
                   default=Path(os.environ.get("JAXSERVE_GOLDEN_DIR",
                                               REPO.parent / "shared" / "golden")))
    p.add_argument("--steps", default="golden,kernel check,kernel bandwidth,roofline smollm2,"
                   "roofline llama-1b,engine decode,tests,profile",
                   help="comma-separated subset, in this order")
    p.add_argument("--tests", type=lambda s: s.split(","), default=None,
                   help="test modules for the tests step (default: by backend)")
    p.add_argument("--context", type=int, default=None,
                   help="decode context (default 2048 on an accelerator, 128 on the CPU)")
    p.add_argument("--batches", type=lambda s: [int(n) for n in s.split(",")],
                   default=[1, 16, 64], help="the roofline's decode batch sizes")
    p.add_argument("--engine-batches", type=lambda s: [int(n) for n in s.split(",")],
                   default=[1, 16], help="LLM.generate's batch sizes in the engine decode step")
    args = p.parse_args()
    args.accelerator = jax.default_backend() != "cpu"
    kind = "accelerator" if args.accelerator else "cpu"
    args.dtype = "bfloat16" if args.accelerator else "float32"
    args.context = args.context or (2048 if args.accelerator else 128)
    args.prefill_seqs, args.prefill_tokens = (4, 512) if args.accelerator else (2, 128)
    args.repeats = 5 if args.accelerator else 2
    args.engine_tokens = 256 if args.accelerator else 32
    args.tests = args.tests or TEST_MODULES[kind]

    report = Report(args.out, args.budget_s)
    # The budget is a promise: when it runs out mid-step, write what is known and stop.
    def stop():
        report.data["stopped"] = "the budget ran out during a step; its results are incomplete"
        report.write()
        print("accelerator_check: budget reached, stopping", flush=True)
        os._exit(3)
    watchdog = threading.Timer(max(1.0, args.budget_s - 3), stop)
    watchdog.daemon = True
    watchdog.start()

    report.data.update(device_facts(args))
    print(f"device: {report.data['device']} ({report.data['versions']}); copy "
          f"{report.data['copy_gb_s']} GB/s, {args.dtype} matmul "
          f"{report.data['matmul_tflop_s']} TFLOP/s", flush=True)
    steps = {"golden": step_golden, "kernel check": step_kernel_check,
             "kernel bandwidth": step_kernel_bandwidth,
             "roofline smollm2": step_roofline("smollm2"),
             "roofline llama-1b": step_roofline("llama-1b"),
             "engine decode": step_engine_decode, "tests": step_tests,
             "profile": step_profile}
    for name in args.steps.split(","):
        need, left = ESTIMATES[name][kind], report.left()
        if left < need:
            status, seconds = f"skipped: needs ~{need} s, {left:.0f} s of the budget left", 0
        else:
            t0 = time.monotonic()
            try:
                steps[name](report, args)
                status = "ok"
            except Exception as e:  # one step's failure is a finding, not the end of the check
                traceback.print_exc()
                status = f"error: {type(e).__name__}: {str(e)[:300]}"
            seconds = round(time.monotonic() - t0, 1)
            jax.clear_caches()
        report.data["steps"].append({"name": name, "status": status, "seconds": seconds})
        print(f"step {name}: {status} ({seconds} s)", flush=True)
        report.write()
    watchdog.cancel()
    g = report.data["golden"]
    print(f"golden {g['passed']} / {g['total']}; report in {args.out}", flush=True)
    return 0 if g["passed"] == g["total"] else 1


if __name__ == "__main__":
    sys.exit(main())

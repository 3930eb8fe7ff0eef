"""One 1,000-question multiple-choice task end to end through `jaxserve eval` (lm-eval's
local-completions, 4 choices a question scored by prompt log-likelihood with completions `echo` +
`logprobs`), against a running server: questions per second, and what the platform's daily load
(10 tasks x 1,000 questions) takes per replica at that rate.

    python -m jaxserve serve --model smollm2-135m-instruct --port 8000 &
    python benchmarks/eval_scale.py --url http://127.0.0.1:8000/v1 [--questions 1000] \
        [--via live batch]

`--via`: the suite version's transport, one run each, in the order given: `live` (lm-eval's
requests on the completions route, `num_concurrent` at a time) or `batch` (the same requests as
one OpenAI batch, run by the server `--batch-max-concurrent-lines` at a time). With both, the
last line holds the batch path's rate as a ratio of the live one's, measured in the same run.

The questions are generated here (arithmetic with three wrong choices next to the sum), so the run
needs no data set download; the answer quality is not the point, the request path is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = """task: arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: arith_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{a}} plus {{b}}?\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, questions: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(folder / "arith_mc.jsonl", "w") as f:
        for _ in range(questions):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            wrong = rng.sample([d for d in range(-9, 10) if d], 3)
            choices = [str(a + b + d) for d in wrong] + [str(a + b)]
            rng.shuffle(choices)
            f.write(json.dumps({"a": a, "b": b, "choices": choices,
                                "answer": choices.index(str(a + b))}) + "\n")
    (folder / "arith_mc.yaml").write_text(TASK)
    return folder / "arith_mc.yaml"


def cpu_flags() -> list[str]:
    """The CPU's SIMD flags (what the kernels were built for), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")))


def run_once(args, via: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder, args.questions)
        (folder / "suite.toml").write_text(
            f'name = "scale"\nstore = "evals.sqlite"\n[[tasks]]\npath = "arith_mc.yaml"\n'
            f'[[versions]]\nname = "v"\nurl = "{args.url}"\nmodel = "{args.model}"\n'
            f'via = "{via}"\nnum_concurrent = {args.num_concurrent}\n'
            f"batch_size = {args.batch_size}\n")
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxserve", "eval", "run",
                               str(folder / "suite.toml")], capture_output=True, text=True,
                              env=dict(os.environ, TQDM_DISABLE="1"))
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(1)
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    run = report["runs"][0]
    rate = run["num_samples"] / seconds
    return {"via": via, "questions": run["num_samples"], "choices_per_question": 4,
            "seconds": round(seconds, 1), "questions_per_second": round(rate, 3),
            "acc": run["score"], "daily_10x1000_hours_per_replica":
            round(10 * 1000 / rate / 3600, 2), "load_average": [round(load, 1),
                                                                round(os.getloadavg()[0], 1)],
            "cpu": os.uname().machine, "cpu_flags": cpu_flags()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://host:8000/v1")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=1000)
    p.add_argument("--num-concurrent", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--via", nargs="+", choices=("live", "batch"), default=["live"])
    args = p.parse_args()
    results = []
    for via in args.via:
        results.append(run_once(args, via))
        print(json.dumps(results[-1]), flush=True)
    rates = {r["via"]: r["questions_per_second"] for r in results}
    if {"live", "batch"} <= rates.keys():
        print(json.dumps({"batch_over_live": round(rates["batch"] / rates["live"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

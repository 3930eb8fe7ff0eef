"""One 1,000-question multiple-choice task end to end through `jaxserve eval` (lm-eval's
local-completions, 4 choices a question scored by prompt log-likelihood with completions `echo` +
`logprobs`), against a running server: questions per second, and what the platform's daily load
(10 tasks x 1,000 questions) takes per replica at that rate.

    python -m jaxserve serve --model smollm2-135m-instruct --port 8000 &
    python benchmarks/eval_scale.py --url http://127.0.0.1:8000/v1 [--questions 1000]

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://host:8000/v1")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=1000)
    p.add_argument("--num-concurrent", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder, args.questions)
        (folder / "suite.toml").write_text(
            f'name = "scale"\nstore = "evals.sqlite"\n[[tasks]]\npath = "arith_mc.yaml"\n'
            f'[[versions]]\nname = "v"\nurl = "{args.url}"\nmodel = "{args.model}"\n'
            f"num_concurrent = {args.num_concurrent}\nbatch_size = {args.batch_size}\n")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxserve", "eval", "run",
                               str(folder / "suite.toml")], capture_output=True, text=True,
                              env=dict(os.environ, TQDM_DISABLE="1"))
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    run = report["runs"][0]
    rate = run["num_samples"] / seconds
    print(json.dumps({"questions": run["num_samples"], "choices_per_question": 4,
                      "seconds": round(seconds, 1), "questions_per_second": round(rate, 2),
                      "acc": run["score"], "daily_10x1000_hours_per_replica":
                      round(10 * 1000 / rate / 3600, 2), "load_average": os.getloadavg()[0],
                      "cpu": os.uname().machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

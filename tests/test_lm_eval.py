"""The real client: lm-evaluation-harness's `local-completions` model, with its default settings,
runs a multiple-choice task and a generation task defined in local files (tests/fixtures/lm_eval)
against a jaxserve server on SmolLM2 (float32). Its default tokenizer backend finds the server's
/tokenizer_info and /tokenize and tokenizes with them; it scores each choice by completions'
`echo` with `logprobs`. Its per-sample log-likelihoods must equal HF transformers' on the same
weights within 1e-3 nats, its greedy flags must agree, and its generations must be HF's greedy
text (tests/fixtures/prompt_logprobs_smollm2.json, from tools/make_prompt_logprobs_fixture.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from tests.test_server import ServerThread

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "prompt_logprobs_smollm2.json")
                       .read_text())["lm_eval"]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = build_engine(SMOLLM2, dtype="float32", num_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=256, min_token_bucket=16,
                          strict_compile=True, progress=False)
    srv = ServerThread(SMOLLM2)
    async_engine = AsyncEngine(engine)
    srv.attach(async_engine)
    yield srv
    srv.stop()
    async_engine.shutdown()
    assert engine.runner.num_serving_compiles == 0


def samples(out: Path, task: str) -> list[dict]:
    [path] = out.rglob(f"samples_{task}_*.jsonl")
    return sorted(map(json.loads, path.read_text().splitlines()), key=lambda s: s["doc_id"])


def test_lm_eval_local_completions_matches_hf(server, tmp_path):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "OPENAI_API_KEY": "unused"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions",
         "--model_args", f"model={SMOLLM2},base_url={server.url}/v1/completions",
         "--tasks", "jaxserve_mc,jaxserve_gen", "--include_path", "tests/fixtures/lm_eval",
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Using remote tokenizer" in run.stderr  # its default found the server's tokenizer

    mc = samples(tmp_path / "out", "jaxserve_mc")
    assert len(mc) == len(REFERENCE["jaxserve_mc"])
    worst = 0.0
    for sample, choices in zip(mc, REFERENCE["jaxserve_mc"]):
        # per choice (loglikelihood, is_greedy), written as strings (lm-eval's sanitize_list)
        got = [(float(ll), greedy == "True") for [[ll, greedy]] in sample["resps"]]
        assert len(got) == len(choices)
        for (ll, greedy), ref in zip(got, choices):
            worst = max(worst, abs(ll - ref["loglikelihood"]))
            assert greedy == ref["is_greedy"]
    print(f"lm-eval log-likelihoods vs HF: largest difference {worst:.3g} nats")
    assert worst <= TOLERANCE

    gen = samples(tmp_path / "out", "jaxserve_gen")
    assert [s["resps"][0][0] for s in gen] == [g["text"] for g in REFERENCE["jaxserve_gen"]]

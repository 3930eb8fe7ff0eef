"""benchmarks/accelerator_check.py rehearsed on the CPU backend with a short budget, as it will run
on a short accelerator lease: the golden cases token-identical, every step ok or skipped for the
budget (never an error), the report written, the budget kept; and the engine's import path free of
the optional libraries the accelerator machine lacks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_engine_import_path_loads_no_optional_library():
    code = ("import sys, jaxserve.entrypoints.llm, jaxserve.core.engine; "
            "print(sorted(m for m in ('llguidance', 'grpc', 'faiss', 'bm25s', 'pydantic', "
            "'aiohttp', 'cachetools', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_rehearsal_on_the_cpu(tmp_path, smollm2_path, golden_dir):
    budget = 180
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "benchmarks/accelerator_check.py", "--out", str(tmp_path),
         "--budget-s", str(budget), "--golden-dir", str(golden_dir),
         "--steps", "golden,roofline smollm2,engine decode,tests",
         # One batch size per step: each step still runs whole, compiling half the programs.
         "--batches", "4", "--engine-batches", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=budget + 120)
    elapsed = time.monotonic() - t0
    # 0: all golden cases passed; 3: the watchdog stopped a later step at the budget (a slow or
    # busy machine), which must still leave a report.
    assert proc.returncode in (0, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "accelerator_check.json").read_text())
    assert (proc.returncode == 3) == ("stopped" in report)
    golden = report["golden"]
    # 5 tokenizer cases, 6 greedy cases twice (chunked, then from the prefix cache), MiniLM's 2.
    assert golden["total"] >= 17 and golden["passed"] == golden["total"], golden
    assert [s["name"] for s in report["steps"]][0] == "golden"
    assert report["steps"][0]["status"] == "ok"
    for step in report["steps"]:
        assert step["status"] == "ok" or step["status"].startswith("skipped: needs"), step
    if proc.returncode == 0:  # each step made its figures (roofline decode, prefill; LLM.generate)
        names = " | ".join(f["name"] for f in report["figures"])
        assert "decode 4 x" in names and "prefill" in names and "batch 4" in names, names
    for figure in report["figures"]:
        assert (figure["value"] or 0) > 0 or figure.get("skipped"), figure
    assert report["device"] and report["copy_gb_s"] > 0
    assert "**Golden:" in (tmp_path / "accelerator_check.md").read_text()
    assert elapsed < budget + 60  # the budget plus the interpreter's start and exit

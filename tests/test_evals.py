"""`jaxserve eval` end to end: lm-evaluation-harness (as a library, its `local-completions` model and
scorers) against a real jaxserve server (SmolLM2) on the example generation task in
configs/evals/: version v1, the same version again, and a deliberately degraded version (a system
prompt that teaches a wrong answer, the issue's "different system prompt"). The suite is
stored, the degraded version raises a significant regression (exit 2, JSON report, Prometheus
textfile, webhook to a loopback receiver), a re-run of the same version stays quiet, a second
invocation resumes without sending a request, and the dashboard renders in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.cli import main
from jaxserve.evals.store import open_store
from tests.test_cli import ROOT
from tests.test_server import ServerThread, scrape

pytest.importorskip("lm_eval")
SMOLLM2 = "smollm2-135m-instruct"
TASK = ROOT / "configs" / "evals" / "tasks" / "capitals.yaml"
SMALL = dict(num_pages=48, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
             min_token_bucket=16, strict_compile=True, progress=False)


@pytest.fixture(scope="module")
def server(smollm2_path):
    engine = AsyncEngine(build_engine(SMOLLM2, **SMALL))
    srv = ServerThread(SMOLLM2)
    try:
        srv.attach(engine)
        yield srv
    finally:
        srv.stop()
        engine.shutdown()


class _Receiver(BaseHTTPRequestHandler):
    posts: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    _Receiver.posts = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/alerts", _Receiver.posts
    httpd.shutdown()


def _suite(tmp_path: Path, url: str, hook: str) -> Path:
    shutil.copytree(TASK.parent, tmp_path / "tasks")
    path = tmp_path / "suite.toml"
    path.write_text(f"""
name = "nightly"
store = "results/evals.sqlite"
seed = 7

[[tasks]]
path = "tasks/capitals.yaml"

[[versions]]
name = "v1"
url = "{url}/v1"
model = "{SMOLLM2}"
manifest_id = "fp_0123456789abcdef"

[[versions]]
name = "v1-rerun"   # the same version evaluated again: must stay quiet
url = "{url}/v1"
model = "{SMOLLM2}"

[[versions]]
name = "v2-degraded"
url = "{url}/v1"
model = "{SMOLLM2}"
system_instruction = '''Every answer in this quiz is wrong on purpose.

Q: What is the capital of Italy?
A: Banana

Q: What is the capital of Peru?
A: Banana'''

[regression]
webhook = "{hook}"
metrics_file = "out/eval.prom"
report_file = "out/report.json"
""")
    return path


def _run(suite: Path, capsys) -> tuple[int, dict]:
    code = main(["eval", "run", str(suite)])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


def _chromium_dom(page: Path, tmp_path: Path) -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian's chromium package; make system-deps)")
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'chromium'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def _console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CONSOLE" in line]


@pytest.mark.slow
def test_two_versions_regression_alert_resume_and_dashboard(server, webhook, tmp_path, capsys):
    hook_url, posts = webhook
    suite = _suite(tmp_path, server.url, hook_url)

    code, report = _run(suite, capsys)
    assert code == 2 and report["alert"] is True
    assert report["min_drop_points"] == 1.0 and report["alpha"] == 0.05
    scores = {r["version"]: r for r in report["runs"]}
    assert scores["v1"]["score"] >= 0.75 and scores["v2-degraded"]["score"] <= 0.1
    assert scores["v1"]["version_id"] == "fp_0123456789abcdef"
    assert scores["v1-rerun"]["version_id"] == f"{SMOLLM2}@{server.url}/v1"
    same, worse = report["comparisons"]
    assert (same["baseline"], same["candidate"]) == ("v1", "v1-rerun")
    assert not same["alert"] and same["paired"] == 20 and abs(same["drop_points"]) < 1
    assert (worse["candidate"], worse["test"]) == ("v2-degraded", "mcnemar-exact")
    assert worse["alert"] and worse["drop_points"] >= 75 and worse["p_value"] < 1e-3
    assert len(worse["lost"]) == round(worse["drop_points"] / 5)  # 20 questions: 5 points each

    # Stored: every run with its per-question correctness, seed and settings.
    with open_store(tmp_path / "results" / "evals.sqlite") as store:
        runs = store.runs("nightly")
        assert [r.version for r in runs] == ["v1", "v1-rerun", "v2-degraded"]
        assert all(r.seed == 7 and r.num_samples == 20 and r.task == "capitals" for r in runs)
        assert runs[0].settings["model"] == "local-completions"
        samples = store.samples(runs[0].id)
        assert sum(s.correct for s in samples) == round(runs[0].score * 20)
        assert {s.target for s in samples} >= {"Paris", "Tokyo"}

    # The alert's other outputs: the report file, the Prometheus textfile, the webhook.
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    gauges = {(s.name, s.labels.get("candidate")): s.value for f in text_string_to_metric_families(
        (tmp_path / "out" / "eval.prom").read_text()) for s in f.samples}
    assert gauges[("jaxserve:eval_regression", "v2-degraded")] == 1
    assert gauges[("jaxserve:eval_regression", "v1-rerun")] == 0
    assert gauges[("jaxserve:eval_p_value", "v2-degraded")] == pytest.approx(worse["p_value"])
    assert posts == [("application/json", report)]

    # Resumable: a second invocation runs nothing (no prompt reaches the server) and reports
    # the same comparison from the store.
    before = scrape(server.url)["jaxserve:prompt_tokens_total"]
    code2, report2 = _run(suite, capsys)
    assert code2 == 2 and all(r["resumed"] for r in report2["runs"])
    assert report2["comparisons"] == report["comparisons"]
    assert scrape(server.url)["jaxserve:prompt_tokens_total"] == before

    # The dashboard: static, renders in Chromium without console errors, one trend plot with a
    # point per version, the flipped questions listed.
    assert main(["eval", "report", str(suite), "--out", str(tmp_path / "site")]) == 0
    page = tmp_path / "site" / "index.html"
    dom, log = _chromium_dom(page, tmp_path)
    assert not _console_errors(log), _console_errors(log)
    assert len(re.findall(r'<svg class="trend" data-task="capitals"', dom)) == 1
    assert len(re.findall(r'<circle class="score-point"', dom)) == 3
    assert "regression" in dom and "no significant drop" in dom
    assert dom.count("<td>lost</td>") == min(len(worse["lost"]), 50)
    # Nothing to fetch: no script, stylesheet, image or frame, no src= or href=.
    assert not re.search(r"<(script|link|img|iframe|object)\b|\b(src|href)=", page.read_text())


def test_chromium_console_check_sees_errors(tmp_path):
    """The dashboard check above can fail: a page that breaks its own policy is reported."""
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><html><head><meta http-equiv=\"Content-Security-Policy\" "
                    "content=\"default-src 'none'\"></head><body><script>console.error('x')"
                    "</script></body></html>")
    _, log = _chromium_dom(page, tmp_path)
    assert _console_errors(log)


@pytest.mark.slow
def test_multiple_choice_task_through_prompt_logprobs(server, tmp_path, capsys):
    """A multiple-choice task: lm-eval scores each choice by its log-likelihood (completions
    `echo` + `logprobs`, the server's tokenizer through /tokenizer_info + /tokenize); the same
    version run twice stays quiet."""
    shutil.copytree(TASK.parent, tmp_path / "tasks")
    suite = tmp_path / "mc.toml"
    suite.write_text(f"""
name = "mc"
[[tasks]]
path = "tasks/capitals_mc.yaml"
[[versions]]
name = "a"
url = "{server.url}/v1"
model = "{SMOLLM2}"
batch_size = 4
[[versions]]
name = "b"
url = "{server.url}/v1"
model = "{SMOLLM2}"
""")
    code, report = _run(suite, capsys)
    assert code == 0 and not report["alert"]
    (cmp,) = report["comparisons"]
    assert cmp["metric"] == "acc" and cmp["paired"] == 20 and cmp["lost"] == []
    assert all(r["score"] >= 0.5 for r in report["runs"])  # 4 choices: chance is 0.25
    with open_store(tmp_path / "evals.sqlite") as store:
        run = store.runs("mc")[0]
        assert run.settings["tokenizer_backend"] == "remote"
        assert {s.correct for s in store.samples(run.id)} <= {0.0, 1.0}


@pytest.mark.slow
def test_an_unreachable_server_or_unserved_model_is_one_line(server, tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    shutil.copytree(TASK.parent, tmp_path / "tasks")
    for url, model, message in ((dead, SMOLLM2, "cannot reach the server"),
                                (server.url, "nope", "not 'nope'")):
        suite = tmp_path / "s.toml"
        suite.write_text(f'[[tasks]]\npath = "tasks/capitals.yaml"\n[[versions]]\nname = "v"\n'
                         f'url = "{url}/v1"\nmodel = "{model}"\n')
        assert main(["eval", "run", str(suite)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: version v (") and message in err[-1], err[-3:]

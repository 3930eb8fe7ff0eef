"""Where a suite's outcome goes besides the exit status: a JSON report file, a Prometheus textfile
(node_exporter's textfile-collector format: gauges, written atomically, no pushgateway) and, when a
comparison alerts, a webhook that receives the JSON report by POST."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

WEBHOOK_TIMEOUT_S = 10


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def write_metrics(report: dict, path: Path) -> None:
    """`jaxserve:eval_score` per (suite, version, task, metric); per comparison
    `jaxserve:eval_regression` (1 = alert), `jaxserve:eval_drop_points` and
    `jaxserve:eval_p_value`."""
    registry = CollectorRegistry()
    run_labels = ("suite", "version", "task", "metric")
    cmp_labels = ("suite", "baseline", "candidate", "task")
    score = Gauge("jaxserve:eval_score", "Score of a version on a task (0..1)", run_labels,
                  registry=registry)
    regression = Gauge("jaxserve:eval_regression", "1 when the candidate dropped significantly "
                       "against the baseline on the same questions", cmp_labels,
                       registry=registry)
    drop = Gauge("jaxserve:eval_drop_points", "Baseline minus candidate score, in percentage "
                 "points, on the paired questions", cmp_labels, registry=registry)
    p_value = Gauge("jaxserve:eval_p_value", "Paired test's p-value of the difference",
                    cmp_labels, registry=registry)
    suite = report["suite"]
    for run in report["runs"]:
        score.labels(suite, run["version"], run["task"], run["metric"]).set(run["score"])
    for c in report["comparisons"]:
        labels = (suite, c["baseline"], c["candidate"], c["task"])
        regression.labels(*labels).set(1 if c["alert"] else 0)
        drop.labels(*labels).set(c["drop_points"])
        p_value.labels(*labels).set(c["p_value"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry)


def post_webhook(report: dict, url: str) -> bool:
    """POST the report; False (and a line on stderr) when it could not be delivered — the
    alert's exit status stands either way."""
    request = urllib.request.Request(url, data=json.dumps(report).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as resp:
            resp.read(1 << 16)
        return True
    except (urllib.error.URLError, OSError) as e:
        print(f"eval: webhook {url} not delivered: {e}", file=sys.stderr)
        return False

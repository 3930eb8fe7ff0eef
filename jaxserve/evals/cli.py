"""`jaxserve eval run SUITE` and `jaxserve eval report SUITE --out DIR`.

`run` prints the JSON report as the last stdout line and exits 0, or 2 when a version regressed
(1 stays "error", as for every command)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxserve.errors import InvalidRequest

EXIT_REGRESSION = 2


def _store(args, suite):
    from jaxserve.evals.store import open_store

    return open_store(args.store or suite.store, suite.path.parent)


def _require_lm_eval() -> None:
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        raise InvalidRequest("jaxserve eval needs lm-evaluation-harness: "
                             "pip install 'jaxserve[eval]'")


def cmd_run(args) -> int:
    from jaxserve.evals.alerts import post_webhook, write_metrics, write_report
    from jaxserve.evals.runner import run_suite
    from jaxserve.evals.suite import load_suite

    _require_lm_eval()
    suite = load_suite(args.suite)
    config = suite.regression
    in_process = (args.in_process() if args.in_process is not None
                  and any(v.in_process for v in suite.versions) else None)
    with _store(args, suite) as store:
        result = run_suite(suite, store, in_process)
        report = result.to_dict(store)
    if config.report_file:
        write_report(report, config.report_file)
    if config.metrics_file:
        write_metrics(report, config.metrics_file)
    if result.alert and config.webhook:
        post_webhook(report, config.webhook)
    print(json.dumps(report))
    return EXIT_REGRESSION if result.alert else 0


def cmd_report(args) -> int:
    from jaxserve.evals.report import write_dashboard
    from jaxserve.evals.suite import load_suite

    suite = load_suite(args.suite)
    with _store(args, suite) as store:
        print(write_dashboard(suite, store, args.out))
    return 0


def add_eval_command(sub, in_process=None) -> None:
    """`in_process()`: what serves the suite versions that name no URL (an evals.runner.InProcess;
    the entrypoints' InProcessVersions)."""
    e = sub.add_parser("eval", help="run eval suites (lm-evaluation-harness) against model "
                                    "versions, store results, alert on regressions")
    esub = e.add_subparsers(dest="eval_command", required=True)
    store_help = ("results store: a SQLite file or a postgresql:// DSN (default: the suite's "
                  "`store`, else evals.sqlite beside it)")
    r = esub.add_parser("run", help="run every (version, task) of SUITE not stored yet; compare "
                                    "each version with the one before it; exit 2 on a regression")
    r.add_argument("suite", type=Path, help="the suite file (TOML)")
    r.add_argument("--store", default=None, help=store_help)
    r.set_defaults(func=cmd_run, in_process=in_process)
    p = esub.add_parser("report", help="write a static HTML dashboard of SUITE's stored runs")
    p.add_argument("suite", type=Path, help="the suite file (TOML)")
    p.add_argument("--store", default=None, help=store_help)
    p.add_argument("--out", type=Path, required=True, help="folder for index.html")
    p.set_defaults(func=cmd_report)

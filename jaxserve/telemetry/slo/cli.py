"""`jaxserve slo rules SLO_FILE` (Prometheus rules, YAML) and `jaxserve slo dashboard SLO_FILE`
(Grafana JSON): written to --output, else to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_slo_command(sub) -> None:
    p = sub.add_parser("slo", help="Prometheus SLO rules (recording + burn-rate alerts) and a "
                                   "Grafana dashboard from an SLO file")
    actions = p.add_subparsers(dest="slo_action", required=True)
    for name, help_ in (("rules", "write Prometheus recording and multi-window, multi-burn-rate "
                                  "alerting rules (check them with `promtool check rules`)"),
                        ("dashboard", "write a Grafana dashboard (JSON) of the SLOs")):
        a = actions.add_parser(name, help=help_)
        a.add_argument("slo_file", type=Path, metavar="SLO_FILE",
                       help="the SLO file (TOML; configs/slo.example.toml)")
        a.add_argument("--output", "-o", type=Path, default=None, metavar="FILE",
                       help="write here (default: stdout)")
        a.set_defaults(func=cmd_slo)


def cmd_slo(args: argparse.Namespace) -> int:
    from jaxserve.telemetry.slo.spec import load_slo_file

    spec = load_slo_file(args.slo_file)
    if args.slo_action == "rules":
        from jaxserve.telemetry.slo.rules import rules_yaml

        text = rules_yaml(spec)
    else:
        from jaxserve.telemetry.slo.dashboard import dashboard_json

        text = dashboard_json(spec)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0

"""A Grafana dashboard (JSON model, schemaVersion 39) of an SLOSpec's recording rules (rules.py):
per SLO, a row; per objective, the error ratio over 5m / 1h / 6h against the fast-burn page
threshold, and the error budget left over the period (from the hourly ratio, averaged: exact
when traffic is even over the period, an estimate otherwise). Its data source is a variable,
`datasource`, so it imports into any Grafana with a Prometheus data source."""

from __future__ import annotations

import json

from jaxserve.telemetry.slo.rules import BURN_ALERTS, OBJECTIVE, RECORD
from jaxserve.telemetry.slo.spec import SLOSpec

_DS = {"type": "prometheus", "uid": "${datasource}"}


def _panel(panel_id: int, title: str, kind: str, targets: list[tuple[str, str]], grid: dict,
           **extra) -> dict:
    return {"id": panel_id, "type": kind, "title": title, "datasource": _DS, "gridPos": grid,
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                         "datasource": _DS} for i, (expr, legend) in enumerate(targets)],
            **extra}


def dashboard(spec: SLOSpec) -> dict:
    panels, y, next_id = [], 0, 1
    fast = BURN_ALERTS[0]
    for slo in spec.slos:
        panels.append({"id": next_id, "type": "row", "title": f"SLO {slo.name}",
                       "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "panels": []})
        next_id, y = next_id + 1, y + 1
        for o in slo.objectives:
            sel = f'{{slo="{slo.name}",sli="{o.sli}"}}'
            page = fast.burn_rate(spec.window_days) * o.budget
            ratios = [(f"{RECORD.format(window=w)}{sel}", w) for w in ("5m", "1h", "6h")]
            panels.append(_panel(
                next_id, f"{slo.name}: {o.sli} error ratio", "timeseries", ratios,
                {"h": 8, "w": 16, "x": 0, "y": y},
                fieldConfig={"defaults": {"unit": "percentunit", "thresholds": {
                    "mode": "absolute", "steps": [{"color": "green", "value": None},
                                                  {"color": "red", "value": page}]},
                    "custom": {"thresholdsStyle": {"mode": "line"}}}, "overrides": []}))
            budget = (f"1 - avg_over_time({RECORD.format(window='1h')}{sel}"
                      f"[{spec.window_days}d]) / (1 - {OBJECTIVE}{sel})")
            panels.append(_panel(
                next_id + 1, f"{slo.name}: {o.sli} error budget left ({spec.window_days} d)",
                "stat", [(budget, "budget left")], {"h": 8, "w": 8, "x": 16, "y": y},
                fieldConfig={"defaults": {"unit": "percentunit", "thresholds": {
                    "mode": "absolute", "steps": [{"color": "red", "value": None},
                                                  {"color": "green", "value": 0.25}]}},
                    "overrides": []}))
            next_id, y = next_id + 2, y + 8
    return {"title": "jaxserve SLOs", "uid": "jaxserve-slo", "schemaVersion": 39,
            "version": 1, "editable": True, "tags": ["jaxserve", "slo"],
            "time": {"from": "now-24h", "to": "now"}, "refresh": "1m",
            "templating": {"list": [{"name": "datasource", "type": "datasource",
                                     "query": "prometheus", "label": "Data source"}]},
            "panels": panels}


def dashboard_json(spec: SLOSpec) -> str:
    return json.dumps(dashboard(spec), indent=2) + "\n"

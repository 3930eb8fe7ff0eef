"""Prometheus rules from an SLOSpec: per SLO and objective, recording rules of the error ratio
over 5m, 30m, 1h and 6h, and the multi-window, multi-burn-rate alerts of the SRE workbook
("Alerting on SLOs"): page when 2 % of the period's error budget burns within an hour (1h window,
confirmed by 5m) or 5 % within six hours (6h, confirmed by 30m). For a 30-day period those are
burn rates 14.4 and 6; other periods scale them.

    jaxserve_slo:error_ratio:rate5m{slo, sli}    the bad share of events over the window
    jaxserve_slo:objective{slo, sli}             the target (for dashboards: budget = 1 - it)

Metric names come from telemetry/sli.py, so the rules read what the server exports. A window
without traffic has no ratio (0/0), so it neither pages nor counts as good.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from jaxserve.telemetry import sli
from jaxserve.telemetry.slo.spec import SLO, Objective, SLOSpec

WINDOWS = ("5m", "30m", "1h", "6h")
RECORD = "jaxserve_slo:error_ratio:rate{window}"
OBJECTIVE = "jaxserve_slo:objective"


@dataclass(frozen=True)
class BurnAlert:
    name: str
    long_window: str
    short_window: str
    long_hours: float
    budget_spent: float  # the share of the period's budget that burns in long_window
    severity: str = "page"

    def burn_rate(self, window_days: int) -> float:
        return self.budget_spent * window_days * 24 / self.long_hours


BURN_ALERTS = (BurnAlert("JaxserveSLOFastBurn", "1h", "5m", 1, 0.02),
               BurnAlert("JaxserveSLOSlowBurn", "6h", "30m", 6, 0.05))


def _selector(equal: dict[str, str], regex: dict[str, str] | None = None) -> str:
    parts = [f'{k}="{v}"' for k, v in equal.items()]
    parts += [f'{k}=~"{v}"' for k, v in (regex or {}).items()]
    return "{" + ",".join(parts) + "}" if parts else ""


def error_ratio(slo: SLO, objective: Objective, window: str) -> str:
    """PromQL: the share of `objective`'s events of `slo`'s traffic that were bad over `window`."""
    m = slo.matchers
    if objective.sli == "availability":
        total = f"{sli.REQUESTS}_total"
        return (f"sum(rate({total}{_selector({**m, 'result': sli.BAD})}[{window}]))\n/\n"
                f"sum(rate({total}{_selector(m, {'result': f'{sli.GOOD}|{sli.BAD}'})}"
                f"[{window}]))")
    if objective.sli == "stream_completion":
        return (f"clamp_min(1 - sum(rate({sli.STREAMS_COMPLETED}_total{_selector(m)}[{window}]))"
                f"\n/\nsum(rate({sli.STREAMS_STARTED}_total{_selector(m)}[{window}])), 0)")
    histogram = sli.TTFT if objective.sli == "ttft" else sli.ITL
    le = floatToGoString(objective.threshold_s)
    return (f"1 - sum(rate({histogram}_bucket{_selector({**m, 'le': le})}[{window}]))\n/\n"
            f"sum(rate({histogram}_count{_selector(m)}[{window}]))")


def _number(x: float) -> str:
    return repr(round(x, 12))


def rule_groups(spec: SLOSpec) -> dict:
    """The rules file's content ({"groups": [...]}), one recording and one alerting group."""
    records, alerts = [], []
    for slo in spec.slos:
        for o in slo.objectives:
            labels = {"slo": slo.name, "sli": o.sli}
            records.append({"record": OBJECTIVE, "expr": f"vector({_number(o.target)})",
                            "labels": labels})
            for w in WINDOWS:
                records.append({"record": RECORD.format(window=w),
                                "expr": error_ratio(slo, o, w), "labels": labels})
            for a in BURN_ALERTS:
                threshold = _number(a.burn_rate(spec.window_days) * o.budget)
                sel = _selector(labels)
                alerts.append({
                    "alert": a.name,
                    "expr": (f"{RECORD.format(window=a.long_window)}{sel} > {threshold}\nand\n"
                             f"{RECORD.format(window=a.short_window)}{sel} > {threshold}"),
                    "labels": {"severity": a.severity, **labels,
                               "long_window": a.long_window, "short_window": a.short_window},
                    "annotations": {
                        "summary": f"SLO {slo.name}: {o.sli} is burning its error budget "
                                   f"{_number(a.burn_rate(spec.window_days))}x too fast",
                        "description": (
                            f"The bad share of {o.sli} events over {a.long_window} and "
                            f"{a.short_window} is above {threshold} ({_number(a.budget_spent * 100)}"
                            f" % of the {spec.window_days}-day error budget of "
                            f"{_number(o.budget)} in {a.long_window})."),
                    }})
    return {"groups": [{"name": "jaxserve-slo-recording", "rules": records},
                       {"name": "jaxserve-slo-alerts", "rules": alerts}]}


def rules_yaml(spec: SLOSpec) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # each rule spells its labels out
            return True

    def text(dumper, value: str):  # expressions of several lines as literal blocks
        return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                       style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return ("# Generated by `jaxserve slo rules` from an SLO file; regenerate, do not edit.\n"
            + yaml.dump(rule_groups(spec), Dumper=Dumper, sort_keys=False, width=100))

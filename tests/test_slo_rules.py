"""`jaxserve slo rules | dashboard` from configs/slo.example.toml, checked with Prometheus' own
promtool: `promtool check rules` on the rules (and on the dashboard's queries), and `promtool test
rules` on synthetic series: a fast burn pages, a quiet series does not, a burst that has stopped
does not (the short window), a slow burn pages only through the 6h window. The rules read metric
names the server really exports (a ServerMetrics is rendered and parsed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.errors import ConfigError
from jaxserve.telemetry.slo.spec import load_slo_file, parse_slo_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "slo.example.toml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian: prometheus) "
                                                             "is not installed")


def jaxserve_slo(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "slo", *args],
                          capture_output=True, text=True, check=True, timeout=120).stdout


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slo") / "rules.yml"
    jaxserve_slo("rules", str(EXAMPLE), "--output", str(path))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_checks_the_rules(rules_file):
    r = promtool("check", "rules", str(rules_file))
    assert r.returncode == 0, r.stdout + r.stderr
    alerts = [rule for g in yaml.safe_load(rules_file.read_text())["groups"]
              for rule in g["rules"] if "alert" in rule]
    # SRE workbook shape: per objective, a 1h/5m page at burn 14.4 and a 6h/30m page at burn 6.
    fast = next(a for a in alerts if a["alert"] == "JaxserveSLOFastBurn"
                and a["labels"]["slo"] == "interactive" and a["labels"]["sli"] == "availability")
    assert "rate1h" in fast["expr"] and "rate5m" in fast["expr"] and "> 0.0144" in fast["expr"]
    slow = next(a for a in alerts if a["alert"] == "JaxserveSLOSlowBurn"
                and a["labels"]["slo"] == "interactive" and a["labels"]["sli"] == "availability")
    assert "rate6h" in slow["expr"] and "rate30m" in slow["expr"] and "> 0.006" in slow["expr"]


def _availability(good: str, bad: str, tier: str = "interactive") -> list[dict]:
    labels = f'model_name="m",route="",tier="{tier}"'
    return [{"series": f'jaxserve:sli_requests_total{{{labels},result="good"}}', "values": good},
            {"series": f'jaxserve:sli_requests_total{{{labels},result="bad"}}', "values": bad},
            {"series": f'jaxserve:sli_requests_total{{{labels},result="excluded"}}',
             "values": "0+500x400"}]  # 4xx: never counted against availability


def _page(alert: str, window: tuple[str, str], sli: str = "availability") -> dict:
    return {"exp_labels": {"severity": "page", "slo": "interactive", "sli": sli,
                           "long_window": window[0], "short_window": window[1]}}


@needs_promtool
def test_promtool_unit_tests_the_burn_rate_alerts(rules_file, tmp_path):
    fast, slow = ("1h", "5m"), ("6h", "30m")
    ttft = 'jaxserve:sli_time_to_first_token_seconds'
    labels = 'model_name="m",route="",tier="interactive"'
    tests = [
        # 10 % of requests fail: burn 100 against a 0.1 % budget; both pages fire.
        {"interval": "1m", "input_series": _availability("0+600x400", "0+60x400"),
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn",
              "exp_alerts": [_page("JaxserveSLOFastBurn", fast)]},
             {"eval_time": "70m", "alertname": "JaxserveSLOSlowBurn",
              "exp_alerts": [_page("JaxserveSLOSlowBurn", slow)]}]},
        # Quiet: no error at all, heavy 4xx: nothing fires.
        {"interval": "1m", "input_series": _availability("0+600x400", "0+0x400"),
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn", "exp_alerts": []},
             {"eval_time": "6h", "alertname": "JaxserveSLOSlowBurn", "exp_alerts": []}]},
        # A burst that stopped 15 minutes ago: the 1h ratio is still high, the 5m one is 0.
        {"interval": "1m", "input_series": _availability("0+600x400", "0+60x55 3300+0x345"),
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn", "exp_alerts": []}]},
        # 1 % errors (burn 10): too slow for the 1h page, caught by the 6h one.
        {"interval": "1m", "input_series": _availability("0+600x400", "0+6x400"),
         "alert_rule_test": [
             {"eval_time": "6h", "alertname": "JaxserveSLOFastBurn", "exp_alerts": []},
             {"eval_time": "6h", "alertname": "JaxserveSLOSlowBurn",
              "exp_alerts": [_page("JaxserveSLOSlowBurn", slow)]}]},
        # TTFT p95 0.5 s (a 5 % budget): 80 % of first tokens over it is a burn of 16...
        {"interval": "1m", "input_series": [
            {"series": f'{ttft}_bucket{{{labels},le="0.5"}}', "values": "0+20x400"},
            {"series": f'{ttft}_count{{{labels}}}', "values": "0+100x400"}],
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn",
              "exp_alerts": [_page("JaxserveSLOFastBurn", fast, "ttft")]}]},
        # ... half of them, a burn of 10, is not a fast one; 99 % within 0.5 s is within it.
        {"interval": "1m", "input_series": [
            {"series": f'{ttft}_bucket{{{labels},le="0.5"}}', "values": "0+50x400"},
            {"series": f'{ttft}_count{{{labels}}}', "values": "0+100x400"}],
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn", "exp_alerts": []}]},
        {"interval": "1m", "input_series": [
            {"series": f'{ttft}_bucket{{{labels},le="0.5"}}', "values": "0+99x400"},
            {"series": f'{ttft}_count{{{labels}}}', "values": "0+100x400"}],
         "alert_rule_test": [
             {"eval_time": "70m", "alertname": "JaxserveSLOFastBurn", "exp_alerts": []}]},
    ]
    for t in tests:  # every alert carries its summary and description; checked apart
        for a in t["alert_rule_test"]:
            for e in a["exp_alerts"]:
                e["exp_annotations"] = _annotations(rules_file, a["alertname"],
                                                    e["exp_labels"])
    spec = tmp_path / "slo_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules_file)],
                                    "evaluation_interval": "1m", "tests": tests}))
    r = promtool("test", "rules", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr


def _annotations(rules_file: Path, alertname: str, labels: dict) -> dict:
    for g in yaml.safe_load(rules_file.read_text())["groups"]:
        for rule in g["rules"]:
            if rule.get("alert") == alertname and all(rule["labels"][k] == v
                                                      for k, v in labels.items()):
                return rule["annotations"]
    raise AssertionError(f"no {alertname} with {labels}")


@needs_promtool
def test_promtool_checks_the_dashboards_queries(tmp_path):
    board = json.loads(jaxserve_slo("dashboard", str(EXAMPLE)))
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 3 * 2 * 3 and board["templating"]["list"][0]["type"] == "datasource"
    # Each query, as a recording rule, through promtool's PromQL parser.
    check = tmp_path / "queries.yml"
    check.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": [
        {"record": f"q:{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    r = promtool("check", "rules", str(check))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_rules_read_metrics_the_server_exports(rules_file):
    from jaxserve.telemetry import sli
    from jaxserve.telemetry.metrics import ServerMetrics

    m = ServerMetrics(dict)
    m.record_sli("m", "", "interactive", 200, "ok", 0.3, True)
    m.sli_streams_started.labels("m", "", "interactive").inc()
    m.sli_itl.labels("m", "", "interactive").observe(0.05)
    exported = {s.name for f in text_string_to_metric_families(m.render().decode())
                for s in f.samples}
    text = rules_file.read_text()
    used = {name for name in exported if name in text}
    for name in (f"{sli.REQUESTS}_total", f"{sli.TTFT}_bucket", f"{sli.TTFT}_count",
                 f"{sli.ITL}_bucket", f"{sli.ITL}_count", f"{sli.STREAMS_STARTED}_total",
                 f"{sli.STREAMS_COMPLETED}_total"):
        assert name in exported and name in used, name


@pytest.mark.parametrize("table, field", [
    ({"slo": [{"name": "x", "ttft_p95_s": 0.3}]}, "ttft_p95_s"),  # not a bucket bound
    ({"slo": [{"name": "x", "availability": 1.0}]}, "availability"),
    ({"slo": [{"name": "x", "tier": "gold", "availability": 0.9}]}, "tier"),
    ({"slo": [{"name": "x"}]}, "no objective"),
    ({"slo": [{"name": "x", "availabilty": 0.9}]}, "availabilty"),
    ({"slo": [{"name": 'a"b', "availability": 0.9}]}, "name"),
    ({"window_days": 0, "slo": [{"name": "x", "availability": 0.9}]}, "window_days"),
    ({"slo": [{"name": "x", "availability": 0.9}, {"name": "x", "availability": 0.9}]},
     "unique"),
])
def test_a_bad_slo_file_is_one_error_naming_the_field(table, field):
    with pytest.raises(ConfigError, match=field):
        parse_slo_spec(table, "slo.toml")


def test_the_example_has_every_objective():
    spec = load_slo_file(EXAMPLE)
    assert {o.sli for s in spec.slos for o in s.objectives} == {
        "availability", "ttft", "itl", "stream_completion"}
    assert spec.window_days == 30

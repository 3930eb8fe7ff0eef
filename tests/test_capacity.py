"""The capacity model (`jaxserve capacity plan`), its measure step on a real engine, and the
`jaxserve:desired_replicas` gauge of a real server that read the rates file."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from jaxserve.entrypoints.capacity import measure
from jaxserve.entrypoints.cli import main
from jaxserve.errors import ConfigError
from jaxserve.telemetry.capacity import Rates, Workload, plan
from tests.test_deploy import DEPLOY, documents
from tests.test_manifest import small_vocab_gguf
from tests.test_server import ServerThread, _request


def test_each_limit_alone_the_binding_one_and_the_zones():
    rates = Rates(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    p = plan(rates, Workload(rps=2.0, prompt_tokens=500, output_tokens=30), 0.2, 3)
    assert math.isclose(p.prefill_replicas, 2 * 500 / (1000 * 0.8))  # 1.25
    assert math.isclose(p.decode_replicas, 2 * 30 / (100 * 0.8))  # 0.75
    assert p.binding == "prefill" and math.isclose(p.need, 1.25)
    assert math.isclose(p.zone_factor, 1.5) and math.isclose(p.desired, 1.875)
    assert (p.per_zone, p.replicas) == (1, 3)  # losing a zone leaves 2 >= 1.25
    decode_bound = plan(rates, Workload(2.0, 10, 300), 0.0, 1)
    assert decode_bound.binding == "decode" and decode_bound.replicas == 6  # exactly 6.0
    assert plan(rates, Workload(0.0, 10, 10), 0.2, 2).replicas == 2  # a replica per zone
    assert plan(rates, Workload(9.0, 100, 10), 0.1, 4).replicas == 4 * math.ceil(1.0 / 3)
    for bad in (lambda: plan(rates, Workload(1, 1, 1), 1.0, 1),
                lambda: plan(rates, Workload(1, 1, 1), 0.2, 0),
                lambda: Workload(-1, 1, 1), lambda: Workload(1, float("nan"), 1),
                lambda: Rates(0.0, 1.0)):
        with pytest.raises(ConfigError):
            bad()


def test_the_cli_plans_from_a_jsonl_workload_and_names_bad_lines(tmp_path, capsys):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100}))
    workload = tmp_path / "requests.jsonl"
    workload.write_text('{"prompt_tokens": 400, "completion_tokens": 20}\n\n'
                        '{"input_tokens": 600, "output_tokens": 40}\n')
    args = ["capacity", "plan", "--rates", str(rates), "--rps", "2", "--workload", str(workload)]
    assert main([*args, "--zones", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["requests"], out["prompt_tokens"], out["output_tokens"]) == (2, 500, 30)
    assert (out["binding"], out["per_zone"], out["replicas"]) == ("prefill", 1, 3)
    assert main([*args, "--headroom", "0"]) == 0
    text = capsys.readouterr().out
    assert "prefill limit: 1.00 replicas" in text and "decode limit:  0.60 replicas" in text
    assert "binding: prefill" in text and text.rstrip().endswith("replicas: 1")
    workload.write_text('{"prompt_tokens": 1, "completion_tokens": 1}\n{"prompt_tokens": -3}\n')
    for extra, words in ((["--zones", "0"], "zones is a whole number"),
                         (["--headroom", "1"], "headroom is a share"),
                         ([], f"{workload}:2: prompt_tokens must be a whole number")):
        assert main([*args, *extra]) == 1
        assert words in capsys.readouterr().err
    rates.write_text('{"prefill_tokens_per_s": "fast", "decode_tokens_per_s": 1}')
    assert main([*args]) == 1 and "prefill_tokens_per_s must be" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = small_vocab_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    # Programs compile when first used (no warmup): this module is about the model and the
    # gauge, and test_sleep keeps the compile guard.
    return build_engine(str(tiny), dtype="bfloat16", max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=16, num_pages=40, warmup=False, progress=False)


def scrape(url: str) -> dict:
    text = _request("GET", f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_measure_then_the_servers_desired_replicas_gauge(engine, tmp_path):
    rates = {"model": "tiny", **measure(engine, 16)}
    assert rates["prefill_tokens_per_s"] > 0 and rates["decode_tokens_per_s"] > 0
    assert rates["decode_batch"] == 4 and rates["prefill_prompt_tokens"] == 16
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(rates))
    srv = ServerThread("tiny", capacity_rates_file=str(path), capacity_headroom=0.25,
                       capacity_zones=3)
    async_engine = AsyncEngine(engine)
    try:
        srv.attach(async_engine)
        first = scrape(srv.url)
        for _ in range(2):
            r = _request("POST", f"{srv.url}/v1/completions",
                         {"model": "tiny", "prompt": list(range(1, 30)), "max_tokens": 5,
                          "ignore_eos": True})
            assert r.status_code == 200, r.text
        second = scrape(srv.url)
    finally:
        srv.stop()
        async_engine.shutdown()
    engine_labels = (("model_name", "tiny"), ("replica", "0"), ("route", ""))

    def delta(name):
        key = (f"jaxserve:{name}_total", engine_labels)
        return second[key] - first[key]

    assert (delta("prompt_tokens"), delta("generation_tokens")) == (58, 10)
    prefill = second[("jaxserve:capacity_replicas", (("limit", "prefill"), ("model_name", "tiny")))]
    decode = second[("jaxserve:capacity_replicas", (("limit", "decode"), ("model_name", "tiny")))]
    desired = second[("jaxserve:desired_replicas", (("model_name", "tiny"),))]
    # The window's seconds cancel in the ratio: the two limits are the counters' deltas over
    # the measured rates.
    assert math.isclose(prefill / decode, (58 / rates["prefill_tokens_per_s"])
                        / (10 / rates["decode_tokens_per_s"]), rel_tol=1e-6)
    assert desired > 0 and math.isclose(desired, max(prefill, decode) * 1.5)
    # The KEDA example's queries read metrics this server exports.
    names = {name for name, _ in second}
    for doc in documents(DEPLOY / "kubernetes" / "fleet.yaml"):
        for trigger in doc.get("spec", {}).get("triggers", []):
            metric = trigger["metadata"]["query"].split("(", 1)[1].split("{", 1)[0]
            assert metric in names, metric

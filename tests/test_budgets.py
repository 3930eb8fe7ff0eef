"""Per-tenant spending budgets (gateway/budgets.py): end to end on a real server (a tiny random
model with SmolLM2's tokenizer, priced so that one request spends a day's budget): the next
request is a 429 `insufficient_quota` (the openai client's RateLimitError) with Retry-After, the
threshold crossings reach a loopback webhook once each and /metrics, other tenants are served,
and the SLI counters see it all. Then the bookkeeping alone: UTC days and months reset, and bad
tenants-file values are refused naming the field."""

from __future__ import annotations

import http.server
import json
import threading
from datetime import datetime, timezone

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.errors import ConfigError, QuotaExceeded
from jaxserve.gateway.budgets import Budgets
from jaxserve.gateway.pricing import Pricing
from jaxserve.gateway.tenants import Tenant, load_tenants
from tests.test_server import ServerThread, _request, wait_for

PRICES = Pricing(prompt_per_1m=1e6, completion_per_1m=1e6)  # $1 a token
TENANTS = """
[tenant.capped]
api_keys = ["sk-capped-0123456789abcdefghij"]
priority = "interactive"
budget_usd_per_day = 5.0
budget_usd_per_month = 1000.0
budget_alert_thresholds = [0.5, 1.0]
budget_webhook = "{webhook}"

[tenant.free]
api_keys = ["sk-free-0123456789abcdefghijkl"]
"""
CAPPED, FREE = "sk-capped-0123456789abcdefghij", "sk-free-0123456789abcdefghijkl"


class Webhook:
    """A loopback HTTP endpoint that keeps each JSON body POSTed to it."""

    def __init__(self):
        self.bodies: list[dict] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                hook.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/budget"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from jaxserve.entrypoints.http.app import attach_engine
    from tests.test_cli import tiny_gguf

    d = tmp_path_factory.mktemp("budgets")
    hook = Webhook()
    (d / "tenants.toml").write_text(TENANTS.format(webhook=hook.url))
    engine = AsyncEngine(build_engine(str(tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields)),
                                      num_pages=32, max_num_seqs=2, max_num_batched_tokens=32,
                                      max_model_len=128, min_token_bucket=16, progress=False))
    http = ServerThread("tiny", tenants_file=str(d / "tenants.toml"))
    http.loop.call_soon_threadsafe(attach_engine, http.app, engine, None, PRICES)
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    yield http, hook
    http.stop()
    engine.shutdown()
    hook.close()


def metrics(url: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(_request("GET", f"{url}/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in m.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_a_spent_budget_is_429_insufficient_quota_with_alerts(server):
    http, hook = server
    capped = openai.OpenAI(base_url=f"{http.url}/v1", api_key=CAPPED, max_retries=0)
    # Under budget: served; its ~10 tokens at $1 each spend the $5 day.
    stream = capped.chat.completions.create(model="tiny", max_tokens=4, stream=True,
                                            messages=[{"role": "user", "content": "hi"}],
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None][0]
    cost = usage.prompt_tokens + usage.completion_tokens
    assert cost >= 5
    with pytest.raises(openai.RateLimitError) as info:
        capped.completions.create(model="tiny", prompt="again", max_tokens=2)
    err = info.value
    assert err.code == "insufficient_quota" and "daily budget of $5" in err.message
    retry_after = float(err.response.headers["retry-after"])
    now = datetime.now(timezone.utc)
    assert 0 < retry_after <= 86400 - (now.hour * 3600 + now.minute * 60) + 1
    # Another tenant is served as before.
    r = _request("POST", f"{http.url}/v1/completions",
                 {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                 headers={"Authorization": f"Bearer {FREE}"})
    assert r.status_code == 200, r.text
    # Each threshold of the day crossed once: 0.5 and 1.0 ($5), POSTed once each.
    bodies = wait_for(lambda: len(hook.bodies) >= 2 and hook.bodies, "two webhook POSTs", 30)
    assert sorted((b["period"], b["threshold"]) for b in bodies) == [("day", 0.5), ("day", 1.0)]
    assert all(b["tenant"] == "capped" and b["budget_usd"] == 5.0 and b["spent_usd"] == cost
               and b["period_start"] == now.strftime("%Y-%m-%d") for b in bodies)
    m = metrics(http.url)
    assert value(m, "jaxserve:tenant_spend_usd", tenant="capped", period="day") == cost
    assert value(m, "jaxserve:tenant_spend_usd", tenant="capped", period="month") == cost
    assert value(m, "jaxserve:tenant_budget_used_ratio", tenant="capped", period="day") \
        == cost / 5
    assert value(m, "jaxserve:tenant_budget_alerts_total", tenant="capped", period="day",
                 threshold="1") == 1
    assert value(m, "jaxserve:tenant_budget_usd", tenant="free") == 0  # no budget, no series
    # The SLIs: the stream started and completed; the 429 is excluded from availability.
    assert value(m, "jaxserve:sli_streams_started_total", tier="interactive") == 1
    assert value(m, "jaxserve:sli_streams_completed_total", tier="interactive") == 1
    assert value(m, "jaxserve:sli_requests_total", tier="interactive", result="good") == 1
    assert value(m, "jaxserve:sli_requests_total", tier="interactive", result="excluded") == 1
    assert value(m, "jaxserve:sli_requests_total", tier="standard", result="good") == 1
    assert value(m, "jaxserve:sli_time_to_first_token_seconds_count", tier="interactive") == 1


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def test_days_and_months_reset_in_utc():
    now = [_at("2026-11-30T23:59:00")]
    sent = []
    t = Tenant("t", budget_usd_per_day=1.0, budget_usd_per_month=3.0,
               budget_alert_thresholds=(1.0,), budget_webhook="http://127.0.0.1:9/x")
    b = Budgets([t, Tenant("other")], clock=lambda: now[0],
                notify=lambda url, body: sent.append(body))
    b.spend("t", 1.0)
    with pytest.raises(QuotaExceeded, match="daily") as info:
        b.check(t)
    assert info.value.retry_after == 60
    b.spend("other", 100.0)  # no budget: nothing counted
    now[0] = _at("2026-12-01T00:00:01")  # a new day and a new month
    b.check(t)
    b.spend("t", 0.5)
    assert b.snapshot()[0] == [("t", "day", 1.0, 0.5), ("t", "month", 3.0, 0.5)]
    assert [(s["period"], s["period_start"]) for s in sent] == [("day", "2026-11-30")]
    for day in range(2, 7):  # $0.5 a day: the month's $3 runs out before any day's $1
        now[0] = _at(f"2026-12-0{day}T12:00:00")
        b.check(t)
        b.spend("t", 0.5)
    with pytest.raises(QuotaExceeded, match="monthly"):
        b.check(t)


@pytest.mark.parametrize("line, field", [
    ("budget_usd_per_day = -1", "budget_usd_per_day"),
    ("budget_usd_per_month = true", "budget_usd_per_month"),
    ("budget_alert_thresholds = [0.5, 1.5]", "budget_alert_thresholds"),
    ("budget_alert_thresholds = []", "budget_alert_thresholds"),
    ('budget_webhook = "file:///etc/passwd"', "budget_webhook"),
])
def test_bad_budget_fields_are_refused_naming_them(tmp_path, line, field):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenant.a]\napi_keys = ["{CAPPED}"]\n{line}\n')
    with pytest.raises(ConfigError, match=field):
        load_tenants(path)

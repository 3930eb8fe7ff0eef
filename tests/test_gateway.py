"""The gateway, host-side: tenants file, API keys, token buckets, idempotency, cost, deadlines."""

from __future__ import annotations

import hashlib
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.errors import (ConfigError, IdempotencyConflict, IdempotencyMismatch, InvalidRequest,
                             ModelNotFound, RateLimitExceeded, Unauthenticated)
from jaxserve.gateway import Gateway, load_tenants, open_tenants
from jaxserve.gateway.deadlines import parse_timeout, request_qos
from jaxserve.gateway.idempotency import IdempotencyStore, StoredResponse, fingerprint, parse_key
from jaxserve.gateway.keys import key_id
from jaxserve.gateway.limits import TokenBucket, format_duration, retry_after_header
from jaxserve.gateway.usage import parse_pricing, pricing_for, with_cost
from jaxserve.core.request import ServiceClass

ACME_KEY = "sk-acme-1"
GLOBEX_KEY = "sk-globex-secret"

TENANTS = f"""
[tenant.acme]
api_keys = ["{ACME_KEY}"]
priority = "interactive"
weight = 4
requests_per_minute = 3
tokens_per_minute = 600
max_concurrent_requests = 4
max_queue_time_s = 30
request_timeout_s = 600
max_tokens_cap = 256
models = ["smol*"]
kv_page_fraction = 0.5
policy = "strict"
audit_content = true
audit_retention_days = 30
cache_sharing_group = "acme-org"

[tenant.globex]
api_key_sha256 = ["{hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()}"]
priority = "batch"
"""


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(tmp_path, text: str):
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


# ---- tenants file ------------------------------------------------------------------------------


def test_tenants_file_every_field(tmp_path):
    tenants = load_tenants(write(tmp_path, TENANTS))
    acme, globex = tenants.get("acme"), tenants.get("globex")
    assert (acme.priority, acme.weight, acme.requests_per_minute, acme.tokens_per_minute,
            acme.max_concurrent_requests, acme.max_queue_time_s, acme.request_timeout_s,
            acme.max_tokens_cap, acme.models, acme.kv_page_fraction, acme.policy,
            acme.audit_content, acme.audit_retention_days, acme.cache_sharing_group) == (
        ServiceClass.INTERACTIVE, 4, 3, 600, 4, 30, 600, 256, ("smol*",), 0.5, "strict", True,
        30, "acme-org")
    assert globex.priority == ServiceClass.BATCH and globex.requests_per_minute is None
    assert globex.models == ("*",) and globex.policy is None and not globex.audit_content
    assert ACME_KEY not in repr(tenants) and GLOBEX_KEY not in repr(tenants)
    assert not tenants.open and open_tenants().open


@pytest.mark.parametrize("text, message", [
    ("[tenant.a\napi_keys = 1", "not valid TOML"),
    ('[tenant.a]\napi_keys = ["k"]\nrate = 3', "tenant.a: unknown field(s) ['rate']"),
    ('[tenant.a]\napi_keys = ["k"]\nrequests_per_minute = -5', "tenant.a.requests_per_minute: "
                                                                "must be >= 1"),
    ('[tenant.a]\napi_keys = ["k"]\ntokens_per_minute = "many"', "tokens_per_minute: must be an "
                                                                 "integer"),
    ('[tenant.a]\napi_keys = ["k"]\nweight = true', "tenant.a.weight: must be a number"),
    ('[tenant.a]\napi_keys = ["k"]\nweight = 0', "tenant.a.weight: must be > 0"),
    ('[tenant.a]\napi_keys = ["k"]\npriority = "urgent"', "tenant.a.priority: must be one of"),
    ('[tenant.a]\napi_keys = ["k"]\nkv_page_fraction = 1.5', "kv_page_fraction: must be > 0 and"),
    ('[tenant.a]\napi_keys = ["k"]\naudit_content = 1', "audit_content: must be true or false"),
    ('[tenant.a]\napi_keys = ["k"]\ntools = ["web_search"]', "tenant.a.tools: unknown tool "
                                                          "type(s) ['web_search']"),
    ('[tenant.a]\napi_keys = ["k"]\ntools = "mcp"', "tenant.a.tools: must be a list"),
    ('[tenant.a]\napi_keys = ["k"]\n[tenant.b]\napi_keys = ["k"]', "tenant.b: an API key is also "
                                                                   "a key of tenant 'a'"),
    ('[tenant.a]\napi_keys = ["k"]\n[tenant.b]\napi_key_sha256 = ["'
     + hashlib.sha256(b"k").hexdigest() + '"]', "tenant.b: an API key is also a key of tenant"),
    ('[tenant.a]\napi_key_sha256 = ["abc"]', "api_key_sha256[0]: not a sha256 hex digest"),
    ('[tenant.a]\nweight = 2', "tenant.a: no key"),
    ('[tenant.a]\napi_keys = "k"', "tenant.a.api_keys: must be a list of non-empty strings"),
    ('[tenant."a b"]\napi_keys = ["k"]', "tenant.a b: a tenant name is"),
    ('[tenants.a]\napi_keys = ["k"]', "unknown top-level field(s) ['tenants']"),
    ("", "no tenant defined"),
])
def test_tenants_file_errors_name_the_file_and_the_field(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_tenants(path)
    assert str(path) in str(e.value) and message in str(e.value)
    assert "sk-" not in str(e.value)


def test_a_missing_tenants_file_and_an_unknown_tenant(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_tenants(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="unknown tenant 'x'; the tenants file defines acme"):
        load_tenants(write(tmp_path, TENANTS)).get("x")


# ---- keys --------------------------------------------------------------------------------------


def test_keys_find_their_tenant_and_never_show(tmp_path, caplog):
    gateway = Gateway(load_tenants(write(tmp_path, TENANTS)))
    acme = gateway.authenticate(f"Bearer {ACME_KEY}")
    globex = gateway.authenticate(f"bearer   {GLOBEX_KEY} ")  # scheme case, spaces
    assert (acme.tenant.name, globex.tenant.name) == ("acme", "globex")
    assert acme.key_id == key_id(hashlib.sha256(ACME_KEY.encode()).digest()) == \
        hashlib.sha256(ACME_KEY.encode()).hexdigest()[:12]
    assert ACME_KEY not in repr(acme)
    for header in (None, "", "Bearer", "Basic abc", f"Bearer {ACME_KEY}x", f"{ACME_KEY}"):
        with pytest.raises(Unauthenticated) as e:
            gateway.authenticate(header)
        assert ACME_KEY not in str(e.value)
    assert ACME_KEY not in caplog.text


def test_a_short_key_is_warned_of_without_showing_it(tmp_path, caplog):
    """Review a70e490, L15: key_id (in every log line and audit record) is a hash of the key, so
    a short key can be found from the logs by trying candidates."""
    caplog.set_level(logging.WARNING, logger="jaxserve.gateway")
    load_tenants(write(tmp_path, '[tenant.acme]\napi_keys = ["sk-acme-1"]\n'))
    assert "tenant.acme.api_keys[0]" in caplog.text and "sk-acme-1" not in caplog.text
    caplog.clear()
    load_tenants(write(tmp_path, '[tenant.acme]\napi_keys = ["sk-' + "k" * 30 + '"]\n'))
    assert caplog.text == ""


def test_an_open_server_admits_anyone_as_default():
    gateway = Gateway()
    for header in (None, "Bearer unused"):
        principal = gateway.authenticate(header)
        assert principal.tenant.name == "default" and principal.key_id is None
    gateway.check(principal, "any-model")
    admission = gateway.admit(principal, [1000], 10_000, n=64)
    assert admission.qos.deadline is None and admission.qos.priority == ServiceClass.STANDARD
    assert gateway.headers(principal) == {}


# ---- limits ------------------------------------------------------------------------------------


def test_token_bucket_refills_continuously():
    bucket = TokenBucket(60, 1.0, now=0.0)
    bucket.take(60, 0.0)
    assert bucket.wait(10, 0.0) == 10 and bucket.wait(10, 4.0) == 6 and bucket.wait(10, 12) == 0
    assert bucket.level(30.0) == 30
    bucket.give_back(100, 30.0)
    assert bucket.level(30.0) == 60  # capped
    assert bucket.wait(61, 0.0) == float("inf")
    assert bucket.until_full(30.0) == 0


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(st.tuples(st.floats(0, 30), st.integers(0, 80)), max_size=30))
def test_token_bucket_never_grants_more_than_capacity_plus_refill(ops):
    bucket, now, granted = TokenBucket(60, 2.0, now=0.0), 0.0, 0
    for dt, amount in ops:
        now += dt
        if bucket.wait(amount, now) == 0:
            bucket.take(amount, now)
            granted += amount
        assert granted <= 60 + 2.0 * now + 1e-6
        assert 0 - 1e-9 <= bucket.level(now) <= 60


def test_limits_requests_tokens_concurrency_and_headers(tmp_path):
    clock = Clock()
    gateway = Gateway(load_tenants(write(tmp_path, TENANTS)), clock)
    acme = gateway.authenticate(f"Bearer {ACME_KEY}")
    assert gateway.headers(acme) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "0ms", "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "600", "x-ratelimit-reset-tokens": "0ms"}
    first = gateway.admit(acme, [20, 30], 100, n=2)  # 50 + 4 x 100 tokens, 4 sequences
    with pytest.raises(RateLimitExceeded, match="Too many concurrent requests") as e:
        gateway.admit(acme, [10], 10)  # 4 sequences run already
    assert e.value.retry_after == 1.0
    first.settle(50 + 40)  # 40 completion tokens used: 360 of the 450 go back
    first.settle(50 + 40)  # once only
    h = gateway.headers(acme)
    assert h["x-ratelimit-remaining-tokens"] == "510" and h["x-ratelimit-remaining-requests"] == "2"
    assert h["x-ratelimit-reset-requests"] == "20s"  # one request at 3 per minute
    assert h["x-ratelimit-reset-tokens"] == "9s"  # 90 tokens at 10 per second
    with pytest.raises(RateLimitExceeded, match="tokens per minute") as e:
        gateway.admit(acme, [100], 500)  # 600 > 510
    assert e.value.retry_after == pytest.approx(9.0)
    clock.now += 9
    gateway.admit(acme, [100], 500).settle(600)
    clock.now += 1
    gateway.admit(acme, [1], 1).settle(2)  # tokens: 10 refilled in that second
    with pytest.raises(RateLimitExceeded, match="requests") as e:
        gateway.check(acme, "smollm2")  # the edge check: 3 requests in 10 s
    assert e.value.retry_after == pytest.approx(10)  # 0.5 request left, 1 per 20 s
    assert [retry_after_header(s) for s in (0.01, 10.0, 10.2)] == ["1", "10", "11"]
    with pytest.raises(RateLimitExceeded, match="Request too large") as e:
        gateway.admit(acme, [500], 200)  # can never pass: no Retry-After
    assert e.value.retry_after is None and e.value.param == "max_tokens"
    with pytest.raises(RateLimitExceeded, match="at most 4 at once") as e:
        gateway.admit(acme, [1], 1, n=5)  # more sequences than the concurrency limit, ever
    assert e.value.retry_after is None and e.value.param == "n"


def test_calls_that_are_not_generations_share_the_limits(tmp_path):
    """tokenize: a request, no slot, no token; an encoder call: a request, a slot while it runs,
    and the tokens it read, taken when it ends (into debt if need be)."""
    clock = Clock()
    gateway = Gateway(load_tenants(write(tmp_path, TENANTS)), clock)
    acme = gateway.authenticate(f"Bearer {ACME_KEY}")
    running = [gateway.admit_call(acme, tokens=True, holds_slot=True) for _ in range(2)]
    with pytest.raises(RateLimitExceeded, match="Too many concurrent requests"):
        gateway.admit(acme, [10], 10, n=3)  # the two calls hold 2 of the 4 slots
    gateway.admit(acme, [10], 10, n=2).settle(30)  # 30 tokens
    with pytest.raises(RateLimitExceeded, match="requests"):
        gateway.admit_call(acme, tokens=False, holds_slot=False)  # 3 requests this minute
    running[0].settle(900)  # more than the bucket holds: 600 - 30 - 900 = -330
    running[1].settle(0)
    h = gateway.headers(acme)
    assert h["x-ratelimit-remaining-tokens"] == "0" and h["x-ratelimit-reset-tokens"] == "1m33s"
    clock.now += 20  # one request back; 200 tokens refilled: still 130 in debt
    with pytest.raises(RateLimitExceeded, match="tokens per minute") as e:
        gateway.admit_call(acme, tokens=True, holds_slot=True)
    assert e.value.retry_after == pytest.approx(13.1)
    gateway.admit_call(acme, tokens=False, holds_slot=False).settle(0)  # tokenize: no tokens


def test_format_duration_like_openai():
    assert [format_duration(s) for s in (0, 0.0201, 1, 1.51, 59.99, 60, 360, 3723)] == [
        "0ms", "21ms", "1s", "1.6s", "60s", "1m0s", "6m0s", "1h2m3s"]


def test_model_globs_and_max_tokens_cap(tmp_path):
    gateway = Gateway(load_tenants(write(tmp_path, TENANTS)))
    acme = gateway.authenticate(f"Bearer {ACME_KEY}")
    gateway.check(acme, "smollm2-135m-instruct")
    with pytest.raises(ModelNotFound):
        gateway.check(acme, "llama-70b")
    assert acme.tenant.max_tokens(None) == 256 and acme.tenant.max_tokens(100) == 100
    with pytest.raises(InvalidRequest) as e:
        acme.tenant.max_tokens(257)
    assert e.value.param == "max_tokens"
    assert gateway.tenants.get("globex").max_tokens(None) is None


# ---- deadlines ---------------------------------------------------------------------------------


def test_deadline_is_the_smaller_of_header_and_tenant(tmp_path):
    acme = load_tenants(write(tmp_path, TENANTS)).get("acme")  # request_timeout_s 600, queue 30
    assert parse_timeout(" 2.5 ") == 2.5 and parse_timeout(None) is None
    for bad in ("0", "-1", "abc", "nan", "inf", ""):
        with pytest.raises(InvalidRequest) as e:
            parse_timeout(bad)
        assert e.value.param == "X-Request-Timeout"
    qos = request_qos(acme, 100.0, 5.0)
    assert (qos.deadline, qos.queue_deadline, qos.tenant, qos.weight, qos.kv_page_fraction,
            qos.priority) == (105.0, 130.0, "acme", 4, 0.5, ServiceClass.INTERACTIVE)
    assert request_qos(acme, 100.0, 9999.0).deadline == 700.0
    assert request_qos(acme, 100.0).deadline == 700.0
    assert request_qos(open_tenants().get("default"), 100.0).deadline is None


# ---- idempotency -------------------------------------------------------------------------------


def test_idempotency_states():
    store = IdempotencyStore(ttl_s=60, clock=Clock())
    fp, other = fingerprint(b'{"a": 1}'), fingerprint(b'{"a": 2}')
    assert store.begin("acme", "k1", fp) is None  # new: run it
    with pytest.raises(IdempotencyConflict):
        store.begin("acme", "k1", fp)  # still running: 409
    with pytest.raises(IdempotencyMismatch):
        store.begin("acme", "k1", other)  # another body: 422
    assert store.begin("globex", "k1", other) is None  # keys are per tenant
    stream = StoredResponse(200, (("content-type", "text/event-stream"),),
                            events=(b'{"id": "x"}', b"[DONE]"))
    store.complete("acme", "k1", fp, stream)
    assert store.begin("acme", "k1", fp) == stream  # replayed as it was
    with pytest.raises(IdempotencyMismatch):
        store.begin("acme", "k1", other)
    store.abandon("globex", "k1")  # failed: a retry runs
    assert store.begin("globex", "k1", other) is None


def test_idempotency_ttl_and_memory_bound():
    clock = Clock()
    fp = fingerprint(b"body")

    def fill(store, keys, body):
        for k in keys:
            assert store.begin("t", k, fp) is None
            store.complete("t", k, fp, StoredResponse(200, body=body))

    by_count = IdempotencyStore(ttl_s=60, max_entries=4, max_bytes=4000, clock=clock)
    fill(by_count, [f"k{i}" for i in range(6)], b"x" * 10)  # 6 small entries into 4
    assert len(by_count) == 4 and by_count.begin("t", "k5", fp) is not None
    assert by_count.begin("t", "k0", fp) is None  # the least recently used went: runs again
    by_size = IdempotencyStore(ttl_s=60, max_entries=100, max_bytes=4000, clock=clock)
    fill(by_size, [f"m{i}" for i in range(10)], b"x" * 450)  # ~480 bytes each into 4000
    assert len(by_size) == 8 and by_size.begin("t", "m0", fp) is None
    assert sum(by_size._size(e) for e in by_size._cache.values()) <= 4000
    by_size.complete("t", "m0", fp, StoredResponse(200, body=b"x" * 501))  # > 4000 / 8
    assert by_size.begin("t", "m0", fp) is None  # not stored: a retry runs again
    clock.now += 61  # past the TTL: everything is forgotten
    assert len(by_count) == 0 and by_count.begin("t", "k5", fp) is None


def test_idempotency_key_header():
    assert parse_key('"abc-123"') == "abc-123" and parse_key("abc") == "abc"
    assert parse_key(None) is None
    for bad in ("", '""', "a" * 256, "caf\u00e9", "a\tb"):
        with pytest.raises(InvalidRequest) as e:
            parse_key(bad)
        assert e.value.param == "Idempotency-Key"


# ---- usage and cost ----------------------------------------------------------------------------


def test_cost_from_the_models_pricing(tmp_path, monkeypatch):
    (tmp_path / "priced.toml").write_text(
        'name = "priced"\nformat = "gguf"\n[source]\npypi = "x==1"\nfile = "m.gguf"\n'
        'sha256 = "00"\n[pricing]\nprompt_per_1m = 0.15\ncompletion_per_1m = 0.6\n')
    (tmp_path / "free.toml").write_text(
        'name = "free"\nformat = "gguf"\n[source]\npypi = "x==1"\nfile = "m.gguf"\nsha256 = "00"\n')
    (tmp_path / "bad.toml").write_text(
        'name = "bad"\nformat = "gguf"\n[source]\npypi = "x==1"\nfile = "m.gguf"\nsha256 = "00"\n'
        '[pricing]\nprompt_per_1m = -1\ncompletion_per_1m = 0.6\n')
    monkeypatch.setenv("JAXSERVE_CONFIGS", str(tmp_path))
    pricing = pricing_for("priced")
    usage = {"prompt_tokens": 1_000, "completion_tokens": 2_000, "total_tokens": 3_000}
    assert with_cost(usage, pricing)["cost"] == pytest.approx(0.00015 + 0.0012)
    assert with_cost(usage, pricing_for("free")) == usage and pricing_for("/a/path.gguf") is None
    with pytest.raises(ConfigError, match=r"bad.toml: pricing.prompt_per_1m: must be a number"):
        pricing_for("bad")
    with pytest.raises(ConfigError, match="unknown field"):
        parse_pricing({"prompt_per_1k": 1}, "x")


def test_cached_prompt_tokens_at_their_own_rate():
    table = {"prompt_per_1m": 2.0, "completion_per_1m": 8.0}
    plain = parse_pricing(table, "x")
    cheap = parse_pricing({**table, "cached_prompt_per_1m": 0.5}, "x")
    usage = {"prompt_tokens": 1_000, "completion_tokens": 100,
             "prompt_tokens_details": {"cached_tokens": 600}}
    assert with_cost(usage, cheap)["cost"] == pytest.approx((400 * 2 + 600 * 0.5 + 100 * 8) / 1e6)
    # Without a cached rate, a cached token costs a prompt token (no discount by default).
    assert with_cost(usage, plain)["cost"] == pytest.approx((1_000 * 2 + 100 * 8) / 1e6)
    assert cheap.cost(10, 0, cached_tokens=50) == pytest.approx(10 * 0.5 / 1e6)  # clamped
    # The cached rate shows only where it is set (manifests of unchanged prices stay the same).
    assert plain.to_dict() == table and cheap.to_dict()["cached_prompt_per_1m"] == 0.5
    with pytest.raises(ConfigError, match=r"x.cached_prompt_per_1m: must be a number"):
        parse_pricing({**table, "cached_prompt_per_1m": -1}, "x")


def test_no_secret_reaches_the_logs(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    gateway = Gateway(load_tenants(write(tmp_path, TENANTS)))
    principal = gateway.authenticate(f"Bearer {ACME_KEY}")
    gateway.admit(principal, [5], 5).settle(10)
    assert ACME_KEY not in caplog.text and ACME_KEY not in repr(principal)

"""The response cache (issue 39; gateway/response_cache.py, serving/response_caching.py): end to
end on a real server (a tiny random model with SmolLM2's tokenizer, priced, with tenants, an audit
log and the admin API) through the openai client: a deterministic repeat is a hit with the same
answer under a new id, at no cost, recorded once as cached, still under the tenant's rate and
budget; streams replay as SSE; another tenant, a tenant that opted out, Cache-Control, sampled
requests and the Responses API are not answered from it; a route's change drops its answers. Then
the cache alone with an injected clock (TTL, LRU bounds), a fleet telling it what changed (route
set, rollback, unload), and the key."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from jaxserve.entrypoints.http.app_state import STATE_KEY
from jaxserve.entrypoints.serving import protocol
from jaxserve.entrypoints.http.sse import sse
from jaxserve.entrypoints.serving.response_caching import (cache_control, cacheable, replayed,
                                                           request_key)
from jaxserve.errors import ConfigError
from jaxserve.gateway.pricing import Pricing
from jaxserve.gateway.response_cache import CachedAnswer, ResponseCache
from jaxserve.gateway.tenants import load_tenants
from tests.test_budgets import metrics, value
from tests.test_server import ServerThread, _request, scrape, wait_for

PRICES = Pricing(prompt_per_1m=1.0, completion_per_1m=2.0)
ADMIN = "admin-key-0123456789abcdef"
KEYS = {"alice": "sk-alice-0123456789abcdefghij", "bob": "sk-bob-0123456789abcdefghijkl",
        "dave": "sk-dave-0123456789abcdefghijk", "erin": "sk-erin-0123456789abcdefghijk",
        "carol": "sk-carol-0123456789abcdefghij"}
# dave has 3 requests a minute, erin a budget the first request spends, carol keeps her requests
# out of the cache.
SETTINGS = {"dave": "requests_per_minute = 3\n", "erin": "budget_usd_per_day = 0.000001\n",
            "carol": "response_cache = false\n"}
TENANTS = "".join(f'[tenant.{name}]\napi_keys = ["{key}"]\n{SETTINGS.get(name, "")}'
                  for name, key in KEYS.items())
EVICTIONS = "jaxserve:response_cache_evictions_total"
CHAT = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from jaxserve.entrypoints.http.admin_routes import add_admin_routes
    from jaxserve.entrypoints.http.app import attach_engine
    from jaxserve.fleet.fleet import Fleet
    from tests.test_cli import tiny_gguf

    d = tmp_path_factory.mktemp("response_cache")
    (d / "tenants.toml").write_text(TENANTS)
    engine = AsyncEngine(build_engine(str(tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields)),
                                      num_pages=32, max_num_seqs=1, max_num_batched_tokens=16,
                                      max_model_len=128, min_token_bucket=16, progress=False))
    fleet = Fleet.of_engine("tiny", engine, pricing=PRICES)
    http = ServerThread("tiny", tenants_file=str(d / "tenants.toml"),
                        audit_log_dir=str(d / "audit"), response_cache_size=16,
                        setup=lambda app: add_admin_routes(app, fleet, ADMIN))
    http.dir = d
    http.loop.call_soon_threadsafe(attach_engine, http.app, None, None, None, fleet)
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    yield http
    http.stop()
    fleet.shutdown()


def client(server, tenant: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[tenant], max_retries=0)


def chat(server, tenant="alice", headers=None, **fields):
    """(x-jaxserve-cache, the parsed ChatCompletion as a dict)."""
    body = {k: v for k, v in {"model": "tiny", "temperature": 0, **CHAT, **fields}.items()
            if v is not None}  # None: left out
    raw = client(server, tenant).chat.completions.with_raw_response.create(
        **body, extra_headers=headers)
    return raw.headers.get("x-jaxserve-cache"), raw.parse().model_dump()


def records(server) -> list[dict]:
    audit = server.app[STATE_KEY].policy.audit
    wait_for(lambda: audit.pending == 0, "the audit writer")
    raw = b"".join(p.read_bytes() for p in sorted((server.dir / "audit").glob("audit-*.jsonl")))
    return [r for r in map(json.loads, raw.splitlines()) if r["type"] == "request"]


def without_ids(body: dict) -> dict:
    usage = {k: v for k, v in body["usage"].items() if k != "cost"}
    return {**{k: v for k, v in body.items() if k not in ("id", "created")}, "usage": usage}


def test_a_deterministic_repeat_is_a_hit_with_the_same_answer_at_no_cost(server):
    before = scrape(server.url)
    status, first = chat(server, messages=[{"role": "user", "content": "A repeat"}])
    assert status == "miss" and first["usage"]["cost"] > 0
    status, second = chat(server, messages=[{"role": "user", "content": "A repeat"}],
                          temperature=0.0, max_tokens=6)  # the same request, spelled otherwise
    assert status == "hit"
    assert second["id"] != first["id"] and second["id"].startswith("chatcmpl-")
    assert without_ids(second) == without_ids(first)  # same choices, tokens, fingerprint
    assert second["usage"]["cost"] == 0.0
    after = scrape(server.url)
    assert after["jaxserve:response_cache_hits_total"] \
        - before.get("jaxserve:response_cache_hits_total", 0) == 1
    assert after["jaxserve:response_cache_misses_total"] \
        - before.get("jaxserve:response_cache_misses_total", 0) == 1
    assert after["jaxserve:response_cache_entries"] >= 1
    assert after["jaxserve:response_cache_bytes"] > 0
    # Recorded once each: the hit as cached, no tokens computed, no cost, the version named.
    by_id = {r["request_id"]: r for r in records(server)}
    hit = by_id[second["id"]]
    assert hit["cached"] is True and hit["cost"] == 0.0 and hit["status"] == "ok"
    assert hit["prompt_tokens"] == hit["completion_tokens"] == 0 and hit["version"] == "tiny"
    assert by_id[first["id"]]["cached"] is False and by_id[first["id"]]["cost"] > 0
    # A seed makes a sampled request deterministic: a text completion, cached too.
    c = client(server).completions.with_raw_response
    seeded = {"model": "tiny", "prompt": "Once", "max_tokens": 5, "temperature": 1.0, "seed": 7}
    a, b = c.create(**seeded), c.create(**seeded)
    assert (a.headers["x-jaxserve-cache"], b.headers["x-jaxserve-cache"]) == ("miss", "hit")
    assert a.parse().choices[0].text == b.parse().choices[0].text


def test_a_stream_is_replayed_as_sse(server):
    def stream():
        raw = client(server).chat.completions.with_raw_response.create(
            model="tiny", temperature=0, stream=True, stream_options={"include_usage": True},
            **{**CHAT, "messages": [{"role": "user", "content": "Stream it"}]})
        chunks = list(raw.parse())
        return raw.headers["x-jaxserve-cache"], raw.headers["content-type"], chunks

    (s1, type1, first), (s2, type2, second) = stream(), stream()
    assert (s1, s2) == ("miss", "hit") and type1 == type2 == "text/event-stream"
    text = lambda chunks: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text(second) == text(first) and len(second) == len(first)
    assert {c.id for c in second} != {c.id for c in first} and len({c.id for c in second}) == 1
    assert second[-1].usage.completion_tokens == first[-1].usage.completion_tokens
    # A plain request is its own entry: not answered with a stream's events.
    assert chat(server, messages=[{"role": "user", "content": "Stream it"}])[0] == "miss"


def test_who_asks_and_how_decide_whether_the_cache_answers(server):
    msg = [{"role": "user", "content": "Whose answer"}]
    assert chat(server, messages=msg)[0] == "miss"
    assert chat(server, messages=msg)[0] == "hit"
    assert chat(server, "bob", messages=msg)[0] == "miss"  # keyed by tenant
    assert chat(server, "carol", messages=msg)[0] == "bypass"  # its tenant opted out
    assert chat(server, "carol", messages=msg)[0] == "bypass"
    # Cache-Control: no-cache runs it again (and keeps the new answer); no-store neither reads
    # nor keeps.
    assert chat(server, messages=msg, headers={"Cache-Control": "no-cache"})[0] == "miss"
    assert chat(server, messages=msg, headers={"Cache-Control": "no-store"})[0] == "bypass"
    fresh = [{"role": "user", "content": "Not kept"}]
    assert chat(server, messages=fresh, headers={"Cache-Control": "no-store"})[0] == "bypass"
    assert chat(server, messages=fresh)[0] == "miss"
    # Sampled without a seed: never cached.
    assert [chat(server, messages=msg, temperature=0.8)[0] for _ in range(2)] == ["bypass"] * 2
    # An error is an error, with no cache header; it cost a request as any refusal does.
    r = _request("POST", f"{server.url}/v1/chat/completions",
                 {"model": "tiny", "temperature": 0, "max_tokens": -1, "messages": msg},
                 headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400 and "x-jaxserve-cache" not in r.headers
    # The Responses API (where the server-side tools are) is never answered from the cache.
    for _ in range(2):
        raw = client(server).responses.with_raw_response.create(
            model="tiny", input="Whose answer", temperature=0, max_output_tokens=4, store=False)
        assert raw.status_code == 200 and "x-jaxserve-cache" not in raw.headers
    # A retrieval request (a server-side tool) is never looked up: here refused, as this
    # server has no retrieval, before anything is cached.
    r = _request("POST", f"{server.url}/v1/chat/completions",
                 {"model": "tiny", "temperature": 0, "messages": msg,
                  "rag": {"collection": "docs"}},
                 headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 400 and "x-jaxserve-cache" not in r.headers


def test_a_hit_is_still_under_the_tenants_rate_and_budget(server):
    msg = [{"role": "user", "content": "Limited"}]
    assert [chat(server, "dave", messages=msg)[0] for _ in range(3)] == ["miss", "hit", "hit"]
    with pytest.raises(openai.RateLimitError) as info:
        chat(server, "dave", messages=msg)
    assert info.value.code == "rate_limit_exceeded"
    assert chat(server, "erin", messages=msg)[0] == "miss"  # spends the day's budget
    with pytest.raises(openai.RateLimitError) as info:
        chat(server, "erin", messages=msg)
    assert info.value.code == "insufficient_quota"


def test_only_answers_cut_at_the_requests_own_length_are_kept(server):
    msg = [{"role": "user", "content": "How long"}]
    # No max_tokens: cut where the context ends (a length the server chose), never kept.
    first = chat(server, messages=msg, max_tokens=None, extra_body={"ignore_eos": True})
    assert first[1]["choices"][0]["finish_reason"] == "length"
    again = chat(server, messages=msg, max_tokens=None, extra_body={"ignore_eos": True})
    assert (first[0], again[0]) == ("miss", "miss")
    # Cut at its own max_tokens: kept.
    own = [chat(server, messages=msg, max_tokens=3, extra_body={"ignore_eos": True})
           for _ in range(2)]
    assert own[0][1]["choices"][0]["finish_reason"] == "length"
    assert [status for status, _ in own] == ["miss", "hit"]


def test_a_hit_of_a_degraded_answer_says_so_as_its_original_did(server):
    # The answer as its route's degradation would have kept it (a version move, which keeps the
    # answer cacheable; tests/test_degrade.py degrades for real): its hit names the reason.
    messages = [{"role": "user", "content": "A degraded one"}]
    assert chat(server, messages=messages)[0] == "miss"
    cache = server.app[STATE_KEY].response_cache
    key, (_, answer) = next(reversed(cache._entries.items()))
    assert answer.degraded == ()  # not degraded: kept as such
    cache.put(key, dataclasses.replace(answer, degraded=("version",)))
    raw = client(server).chat.completions.with_raw_response.create(
        model="tiny", temperature=0, max_tokens=CHAT["max_tokens"], messages=messages)
    assert raw.headers["x-jaxserve-cache"] == "hit"
    assert raw.headers["x-jaxserve-degraded"] == "version"


def test_a_routes_change_drops_its_answers(server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    put = lambda body: _request("PUT", f"{server.url}/admin/v1/routes/chat", body, headers=admin)
    assert put({"weights": {"tiny": 1}}).status_code == 200
    msg = [{"role": "user", "content": "Routed"}]
    assert [chat(server, model="chat", messages=msg)[0] for _ in range(2)] == ["miss", "hit"]
    assert [chat(server, messages=msg)[0] for _ in range(2)] == ["miss", "hit"]  # by name
    before = value(metrics(server.url), EVICTIONS, reason="invalidated")
    assert put({"weights": {"tiny": 1}, "sticky": "user"}).status_code == 200
    assert chat(server, model="chat", messages=msg)[0] == "miss"  # the route changed
    assert chat(server, messages=msg)[0] == "hit"  # the version itself did not
    assert chat(server, model="chat", messages=msg)[0] == "hit"
    r = _request("POST", f"{server.url}/admin/v1/routes/chat/rollback", headers=admin)
    assert r.status_code == 200
    assert chat(server, model="chat", messages=msg)[0] == "miss"
    # Two changes, each dropping the route's one answer.
    assert value(metrics(server.url), EVICTIONS, reason="invalidated") - before == 2


# ---- the cache alone ----------------------------------------------------------------------------


def _answer(n: int, route: str = "", version: str = "v1") -> CachedAnswer:
    return CachedAnswer(b"x" * n, (), version, route, ("stop",))


def test_entries_expire_after_the_ttl():
    now = [100.0]
    cache = ResponseCache(8, 1 << 20, ttl_s=60, clock=lambda: now[0])
    cache.put(b"k", _answer(10))
    now[0] = 159.9
    assert cache.get(b"k") is not None  # a hit does not extend its life
    now[0] = 160.0
    assert cache.get(b"k") is None
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions["expired"], s.entries, s.bytes) == (1, 1, 1, 0, 0)


def test_entries_and_bytes_are_bounded_least_recently_used_first():
    cache = ResponseCache(3, 800, ttl_s=60)
    for k in (b"a", b"b", b"c"):
        cache.put(k, _answer(100))
    cache.get(b"a")  # now b is the least recently used
    cache.put(b"d", _answer(100))
    assert cache.get(b"b") is None and cache.get(b"a") is not None
    assert not cache.put(b"big", _answer(101))  # over max_bytes / 8: not kept
    cache.put(b"e", _answer(100))  # 4 entries: the oldest goes
    assert cache.stats().entries == 3 and cache.stats().evictions["size"] == 2
    small = ResponseCache(100, 250, ttl_s=60)  # bytes bind before entries
    for i in range(5):
        small.put(bytes([i]), _answer(31))
    assert small.stats().bytes <= 250 and small.stats().entries == 5
    for i in range(5, 12):
        small.put(bytes([i]), _answer(31))
    assert small.stats().bytes <= 250 and small.stats().entries == 8


def test_invalidation_drops_a_routes_or_a_versions_answers():
    cache = ResponseCache(8, 1 << 20, ttl_s=60)
    cache.put(b"1", _answer(1, route="chat", version="v1"))
    cache.put(b"2", _answer(1, route="", version="v1"))
    cache.put(b"3", _answer(1, route="other", version="v2"))
    assert cache.invalidate(route="chat") == 1
    assert cache.invalidate(version="v1") == 1
    assert cache.get(b"3") is not None and cache.stats().evictions["invalidated"] == 2


def test_the_fleet_tells_the_cache_what_changed():
    from tests.test_fleet import ready_fleet, route

    fleet, cache = ready_fleet("a", "b"), ResponseCache(8, 1 << 20, ttl_s=60)
    fleet.on_change(cache.invalidate)
    try:
        fleet.set_route(route("r", {"a": 1, "b": 1}))
        for key, answer in ((b"r-a", _answer(1, "r", "a")), (b"r-b", _answer(1, "r", "b")),
                            (b"b", _answer(1, "", "b")), (b"a", _answer(1, "", "a"))):
            cache.put(key, answer)
        fleet.set_route(route("r", {"a": 1}))  # the route's versions change: its answers go
        assert [cache.get(k) is None for k in (b"r-a", b"r-b", b"b", b"a")] == \
            [True, True, False, False]
        cache.put(b"r-a", _answer(1, "r", "a"))
        fleet.rollback("r")  # back to a and b
        assert cache.get(b"r-a") is None
        fleet.set_route(route("r", {"a": 1}))
        fleet.unload("b")  # once unloaded, what b answered by name goes too
        assert fleet.wait("b", 10).state.value == "unloaded"
        assert cache.get(b"b") is None and cache.get(b"a") is not None
    finally:
        fleet.shutdown()


def test_the_key_is_the_canonical_request():
    parse = lambda body: protocol.parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    a = parse({"temperature": 0, "max_tokens": 4})
    b = parse({"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "n": 1})  # defaults written
    assert request_key("t", "v", "mf", a) == request_key("t", "v", "mf", b)
    assert request_key("t", "v", "mf", a) != request_key("u", "v", "mf", a)
    assert request_key("t", "v", "mf", a) != request_key("t", "v", "mf2", a)
    assert request_key("t", "v", "mf", a) != request_key("t", "v", "mf",
                                                         parse({"temperature": 0,
                                                                "max_tokens": 5}))
    assert cacheable(a) and cacheable(parse({"seed": 3}))
    assert not cacheable(parse({"temperature": 0.5}))
    assert not cacheable(parse({"temperature": 0, "rag": {"collection": "docs"}}))
    assert cache_control(None) == (True, True)
    assert cache_control("max-age=0, No-Cache") == (False, True)
    assert cache_control("no-store") == (False, False)


def test_a_replay_rewrites_only_the_ids_and_the_cost():
    chunk = {"id": "chatcmpl-old", "created": 1, "choices": [{"delta": {"content": "data: x\n"}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": 0.5}}
    events = (sse(chunk), sse({"type": "done", "id": "chatcmpl-old"}, "done"), sse("[DONE]"))
    answer = replayed(CachedAnswer(None, events, "v", ""), "chatcmpl-new")
    first = json.loads(answer.events[0].removeprefix(b"data: "))
    assert first["id"] == "chatcmpl-new" and first["created"] > 1
    assert first["choices"] == chunk["choices"] and first["usage"] == {**chunk["usage"],
                                                                       "cost": 0.0}
    assert answer.events[1].startswith(b"event: done\ndata: {")
    assert json.loads(answer.events[1].split(b"data: ", 1)[1])["id"] == "chatcmpl-new"
    assert answer.events[2] == b"data: [DONE]\n\n"
    body = replayed(CachedAnswer(json.dumps(chunk).encode(), (), "v", ""), "chatcmpl-new").body
    assert json.loads(body)["id"] == "chatcmpl-new"


def test_a_bad_tenant_setting_is_refused_naming_it(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenant.a]\napi_keys = ["{KEYS["alice"]}"]\nresponse_cache = "no"\n')
    with pytest.raises(ConfigError, match="response_cache"):
        load_tenants(path)

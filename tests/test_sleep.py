"""Sleep and wake (vLLM's POST /sleep, /wake_up, GET /is_sleeping) on a real server over a fleet of
one tiny version: level 1 frees the KV cache, level 2 also moves the weights to host memory; a
sleeping version answers 503, /ready says "asleep" and its metrics stay (0 in use); waking
compiles nothing (strict compile) and answers as before; requests in flight finish first; a
routed version does not sleep; bad query parameters are 400s naming them; the routes need the
admin key."""

from __future__ import annotations

import json
import threading
import urllib.request

import jax
import pytest

from jaxserve.entrypoints.http.admin_routes import add_admin_routes
from jaxserve.entrypoints.http.app import attach_engine
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.loader import EngineLoader
from jaxserve.fleet.manifest import FileHashCache
from tests.test_manifest import small_vocab_gguf
from tests.test_server import ServerThread, _request, scrape, wait_for

KEY = "sleepy-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
ENGINE = (("max_model_len", 64), ("max_num_batched_tokens", 16), ("max_num_seqs", 2),
          ("num_pages", 24))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = small_vocab_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    hashes = FileHashCache(tmp_path_factory.mktemp("hashes") / "hashes.json")
    fleet = Fleet(EngineLoader(strict_compile=True, hashes=hashes))
    fleet.load(VersionSpec("v1", str(tiny), None, ENGINE))
    assert fleet.wait("v1").state.value == "ready"
    http = ServerThread("v1", setup=lambda app: add_admin_routes(app, fleet, KEY))
    http.loop.call_soon_threadsafe(lambda: attach_engine(http.app, None, fleet=fleet))
    wait_for(lambda: _request("GET", f"{http.url}/ready").status_code == 200, "ready")
    yield http, fleet
    http.stop()
    fleet.shutdown()


def admin(url: str, method: str, path: str, headers=ADMIN):
    return _request(method, f"{url}{path}", None, headers=headers)


def complete(url: str, max_tokens: int = 6):
    return _request("POST", f"{url}/v1/completions",
                    {"model": "v1", "prompt": list(range(1, 22)), "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True})


def test_sleep_levels_and_wake_answer_as_before_without_compiling(server):
    http, fleet = server
    url = http.url
    before = complete(url)
    assert before.status_code == 200, before.text
    runner = fleet._versions["v1"].engine.engine.runner
    assert admin(url, "GET", "/is_sleeping").json() == {
        "model": "v1", "is_sleeping": False, "state": "ready", "sleeping": []}

    awake = scrape(url)
    # level 1: the KV pool freed, the prefix cache forgotten; requests get 503, /ready "asleep"
    r = admin(url, "POST", "/sleep?level=1")
    assert r.status_code == 200 and r.json()["sleeping"] == ["kv_cache"], r.text
    assert runner.kv_cache is None and all(x.sharding.memory_kind == "device"
                                           for x in jax.tree.leaves(runner.params))
    cache = fleet._versions["v1"].engine.engine.scheduler.cache
    assert cache.num_cached_free_pages == 0 and cache.num_free_pages == cache.num_usable_pages
    asleep = complete(url)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    ready = _request("GET", f"{url}/ready")
    assert (ready.status_code, ready.json()) == (503, {"status": "asleep"})
    assert admin(url, "GET", "/admin/v1/versions/v1").json()["state"] == "sleeping"
    # its series stay, reading what it holds (nothing) and its counts so far, not vanishing
    metrics = scrape(url)
    assert metrics["jaxserve:num_requests_running"] == metrics["jaxserve:num_requests_waiting"] \
        == metrics["jaxserve:kv_cache_usage_perc"] == 0
    assert metrics["jaxserve:generation_tokens_total"] \
        == awake["jaxserve:generation_tokens_total"] == before.json()["usage"]["completion_tokens"]

    r = admin(url, "POST", "/wake_up")
    assert r.status_code == 200 and r.json()["is_sleeping"] is False, r.text
    assert complete(url).json()["choices"] == before.json()["choices"]

    # level 2: the weights in host memory too; a partial wake (weights) leaves it asleep
    r = admin(url, "POST", "/sleep?level=2&model=v1")
    assert r.json()["sleeping"] == ["kv_cache", "weights"], r.text
    leaves = jax.tree.leaves(runner.params)
    assert leaves and all(x.sharding.memory_kind == "pinned_host" for x in leaves)
    r = admin(url, "POST", "/wake_up?tags=weights")
    assert r.json()["sleeping"] == ["kv_cache"] and r.json()["state"] == "sleeping"
    assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(runner.params))
    assert admin(url, "POST", "/wake_up?tags=kv_cache&tags=weights").json()["state"] == "ready"
    assert complete(url).json()["choices"] == before.json()["choices"]
    assert runner.num_serving_compiles == 0  # strict: a compile would have failed the request


def test_requests_in_flight_finish_before_the_version_sleeps(server):
    http, fleet = server
    url = http.url
    body = json.dumps({"model": "v1", "prompt": list(range(1, 22)), "max_tokens": 40,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    stream = urllib.request.urlopen(urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}),
        timeout=120)
    assert stream.readline().startswith(b"data: ")  # the request runs
    # timeout 0: the request is still running, so the version stays as it was (409)
    r = admin(url, "POST", "/sleep?timeout=0")
    assert r.status_code == 409 and r.json()["error"]["param"] == "timeout", r.text
    assert fleet._versions["v1"].state.value == "ready"
    slept = {}
    thread = threading.Thread(target=lambda: slept.setdefault(
        "r", admin(url, "POST", "/sleep?level=1")))  # waits for the stream to end
    thread.start()
    rest = stream.read().decode()
    thread.join(120)
    assert rest.rstrip().endswith("data: [DONE]") and '"length"' in rest
    assert slept["r"].status_code == 200 and slept["r"].json()["is_sleeping"] is True
    assert admin(url, "POST", "/wake_up").json()["state"] == "ready"


def test_a_routed_version_does_not_sleep_and_bad_parameters_are_400(server):
    http, fleet = server
    url = http.url
    for path, param in (("/sleep?level=3", "level"), ("/sleep?level=1&level=2", "level"),
                        ("/sleep?timeout=abc", "timeout"), ("/sleep?timeout=nan", "timeout"),
                        ("/sleep?timeout=601", "timeout"), ("/sleep?force=1", "force"),
                        ("/wake_up?tags=everything", "tags")):
        r = admin(url, "POST", path)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), (path, r.text)
    r = admin(url, "POST", "/sleep?model=nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "name"
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = admin(url, method, path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _request("PUT", f"{url}/admin/v1/routes/r", {"weights": {"v1": 1}},
                    headers=ADMIN).status_code == 200
    r = admin(url, "POST", "/sleep")
    assert r.status_code == 409 and "route(s) r" in r.json()["error"]["message"], r.text
    assert _request("POST", f"{url}/v1/completions",
                    {"model": "r", "prompt": [1, 2], "max_tokens": 1}).status_code == 200
    assert fleet._versions["v1"].state.value == "ready"

"""The admin API over a fleet of real tiny-model engines (the registry's load path end to end):
401 without the key; load (202, loading -> ready, compiled before traffic, manifest); bad bodies
and a version that does not fit; routes (PUT, GET, rollback); a request through the fleet's
selection on a real engine; DELETE refused while routed, then drain of an in-flight request and
the memory freed."""

from __future__ import annotations

import asyncio
import hashlib
import time

import jax
import pytest
from aiohttp.test_utils import TestClient, TestServer

from jaxserve.config import ServerConfig
from jaxserve.fleet.fleet import Fleet
from jaxserve.fleet.loader import EngineLoader
from jaxserve.fleet.manifest import FileHashCache
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.entrypoints.http.admin_routes import add_admin_routes
from jaxserve.entrypoints.http.app import build_app
from tests.test_manifest import small_vocab_gguf

KEY = "s3cret-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# One token bucket (16) per version: the admin API is the subject here, not small steps.
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 16,
          "min_token_bucket": 16, "num_pages": 40}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return small_vocab_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    hashes = FileHashCache(tmp_path_factory.mktemp("hashes") / "hashes.json")
    fleet = Fleet(EngineLoader(strict_compile=True, hashes=hashes, stall_timeout=7.5))
    yield fleet
    fleet.shutdown()


def run(fleet: Fleet, scenario, model_roots=()) -> None:
    async def main():
        # No throttle: the first test sends 24 wrong keys from one address on purpose.
        app = build_app(ServerConfig(port=0, auth_failures_per_minute=0), "unused")
        add_admin_routes(app, fleet, KEY, model_roots)
        async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
            await scenario(client)
    asyncio.run(main())


async def wait_state(client, name: str, state: str) -> dict:
    deadline = time.monotonic() + 600  # loading a version on a busy 2-core machine: a bound
    while time.monotonic() < deadline:
        info = await (await client.get(f"/admin/v1/versions/{name}", headers=AUTH)).json()
        if info["state"] == state:
            return info
        assert info["state"] in ("loading", "draining"), info
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never became {state}")


def test_admin_routes_need_the_key(fleet):
    async def scenario(client):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            for method, path in (("GET", "/admin/v1/versions"), ("GET", "/admin/v1/routes"),
                                 ("POST", "/admin/v1/versions"),
                                 ("PUT", "/admin/v1/routes/r"),
                                 ("POST", "/admin/v1/routes/r/rollback"),
                                 ("DELETE", "/admin/v1/versions/v")):
                r = await client.request(method, path, headers=headers, json={})
                assert r.status == 401, (method, path, headers)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/admin/v1/versions", headers=AUTH)).status == 200

    run(fleet, scenario)


def test_load_route_serve_rollback_and_unload(fleet, tiny_path, tmp_path):
    other = small_vocab_gguf(tmp_path / "other.gguf", seed=1)

    async def scenario(client):
        def post(body):
            return client.post("/admin/v1/versions", json=body, headers=AUTH)

        def put(body):
            return client.put("/admin/v1/routes/tiny", json=body, headers=AUTH)

        # load two versions: 202 at once, loading -> ready, every program compiled first
        r = await post({"name": "v1", "model": str(tiny_path), **ENGINE})
        assert r.status == 202 and r.headers["Location"] == "/admin/v1/versions/v1"
        assert (await r.json())["state"] in ("loading", "ready")
        r = await post({"name": "v2", "model": str(other), **ENGINE,
                        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                        "generation": {"temperature": 0.0},
                        "pricing": {"prompt_per_1m": 1, "completion_per_1m": 2}})
        assert r.status == 202
        v1 = await wait_state(client, "v1", "ready")
        v2 = await wait_state(client, "v2", "ready")
        assert v1["compile_seconds"] > 0 and v1["memory"]["num_pages"] == 40
        weights = v1["manifest"]["weights"][0]
        assert weights["sha256"] == hashlib.sha256(tiny_path.read_bytes()).hexdigest()
        assert v1["system_fingerprint"] == v1["manifest"]["id"] != v2["system_fingerprint"]
        assert v2["pricing"] == {"prompt_per_1m": 1.0, "completion_per_1m": 2.0}
        runner = fleet._versions["v1"].engine.engine.runner
        assert runner._warm and runner.strict
        assert fleet._versions["v1"].engine.stall_timeout == 7.5  # serve --engine-stall-timeout

        # bad loads: the field named; an unknown model 404; a taken name 409; too big 409
        for body, status, param in (
                ({"name": "v3", "model": str(tiny_path), "max_model_len": "x"}, 400,
                 "max_model_len"),
                ({"name": "v3", "model": str(tiny_path), "gpu": 1}, 400, "gpu"),
                ({"name": "v3", "model": str(tiny_path), "generation": {"top_p": 7.0}}, 400,
                 "generation.top_p"),
                ({"name": "v3", "model": str(tiny_path), "max_model_len": 4096}, 400,
                 "max_model_len"),
                ({"name": "a/b", "model": str(tiny_path)}, 400, "name"),
                ({"model": str(tiny_path)}, 400, "name"),
                # (under a model root: outside them nothing says whether a path exists)
                ({"name": "v3", "model": str(tmp_path / "no-such-model.gguf")}, 404, "model"),
                ({"name": "v1", "model": str(tiny_path)}, 409, "name")):
            r = await post(body)
            assert r.status == status, (body, await r.text())
            assert (await r.json())["error"]["param"] == param, body
        r = await post({"name": "huge", "model": str(tiny_path), **ENGINE,
                        "num_pages": 2**40})
        assert r.status == 409
        error = (await r.json())["error"]
        assert error["code"] == "insufficient_memory" and "huge does not fit" in error["message"]
        assert "huge" not in [v["name"] for v in (await (await client.get(
            "/admin/v1/versions", headers=AUTH)).json())["data"]]

        # a route; then a request through the fleet's choice lands on a real engine
        r = await put({"weights": {"v1": 1, "v2": 1}, "sticky": "user"})
        assert r.status == 200 and (await r.json())["weights"] == {"v1": 1.0, "v2": 1.0}
        lease = fleet.select("tiny", user="alice")
        with lease:
            out = None
            async for out in lease.version.engine.generate(
                    [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)):
                pass
            assert len(out.outputs[0].token_ids) == 4
            lease.finish(ttft=0.01, prompt_tokens=3, completion_tokens=4)
        routes = (await (await client.get("/admin/v1/routes", headers=AUTH)).json())["data"]
        counters = routes[0]["versions"][lease.version.name]["counters"]
        assert (counters["requests"], counters["completion_tokens"]) == (1, 4)
        assert routes[0]["sticky"] == "user" and routes[0]["has_previous"] is False

        # unload: refused while routed (409), then drains its in-flight request and frees
        r = await client.delete("/admin/v1/versions/v2", headers=AUTH)
        assert r.status == 409 and (await r.json())["error"]["code"] == "conflict"
        assert (await put({"weights": {"v1": 1, "v2": 0}})).status == 200
        lease = fleet.select("v2")
        stream = lease.version.engine.generate(
            [5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
        first = await stream.__anext__()
        runner = lease.version.engine.engine.runner
        r = await client.delete("/admin/v1/versions/v2", headers=AUTH)
        assert r.status == 202 and (await r.json())["state"] == "draining"
        async for out in stream:  # the in-flight request runs to its end
            pass
        assert first is not out and len(out.outputs[0].token_ids) == 8
        lease.finish(prompt_tokens=2, completion_tokens=8)
        await wait_state(client, "v2", "unloaded")
        assert runner.kv_cache.is_deleted() and all(
            leaf.is_deleted() for leaf in jax.tree.leaves(runner.params))

        # rollback: back to both weighted, which names an unloaded version: 409
        r = await client.post("/admin/v1/routes/tiny/rollback", headers=AUTH)
        assert r.status == 409 and "'v2' is unloaded" in (await r.json())["error"]["message"]
        assert (await put({"sticky": "none"})).status == 200  # partial: weights kept
        r = await client.post("/admin/v1/routes/tiny/rollback", headers=AUTH)
        assert r.status == 200 and (await r.json())["sticky"] == "user"
        assert (await r.json())["weights"] == {"v1": 1.0, "v2": 0.0}
        r = await client.post("/admin/v1/routes/nope/rollback", headers=AUTH)
        assert r.status == 404
        r = await client.put("/admin/v1/routes/new", json={"sticky": "user"}, headers=AUTH)
        assert r.status == 400 and (await r.json())["error"]["param"] == "weights"

    run(fleet, scenario, [tiny_path.parent, tmp_path])


def test_admin_paths_stay_under_the_model_roots(fleet, tiny_path, tmp_path):
    """Review a70e490, M4: a path the admin names is read only under the configured roots, and a
    chat template only as its text (an /etc/passwd template would come back by detokenize)."""
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "tiny.gguf").write_bytes(tiny_path.read_bytes())
    (root / "link.gguf").symlink_to(outside / "tiny.gguf")

    async def scenario(client):
        for body, param, words in (
                ({"model": str(tiny_path), "chat_template": "/etc/passwd"}, "chat_template",
                 "the template's text"),
                ({"model": str(tiny_path), "chat_template": str(tiny_path)}, "chat_template",
                 "the template's text"),
                ({"model": "/etc/passwd"}, "model", "nor a path under"),
                ({"model": str(outside / "tiny.gguf")}, "model", "nor a path under"),
                ({"model": str(root / ".." / "elsewhere" / "tiny.gguf")}, "model", "nor a path under"),
                ({"model": str(root / "link.gguf")}, "model", "nor a path under")):
            r = await client.post("/admin/v1/versions", json={"name": "x", **body},
                                  headers=AUTH)
            error = (await r.json())["error"]
            assert (r.status, error["param"]) == (400, param), (body, error)
            assert words in error["message"] and "root:" not in error["message"], error

    run(fleet, scenario, [root, tiny_path.parent])

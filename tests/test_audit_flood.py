"""What nobody can be held to must not grow the audit log (review a70e490, H6): real servers
with a tenants file and --audit-log, no engine (refusals come before it). A flood of wrong keys is
throttled per client before its key is checked (429, even a right key, until the window ends)
and written as one `refusals` summary per client per interval, not a record per request; the
log's disk use is capped (503 once full, a warning and the headroom gauge before), and the
refusals it causes are summarised too. The admin API (M3): every call with the admin key is an
`admin` record (method, path, status, body), a wrong admin key is throttled and summarised like a
tenant's, its routes cannot be registered unguarded, the key can come from a file or the
environment, and GET /admin/v1/audit/head exports the head that `verify --head` checks."""

from __future__ import annotations

import json
import logging

import pytest

from aiohttp import web

from jaxserve.audit import verify
from jaxserve.entrypoints.http.admin_routes import add_admin_routes, admin_key
from jaxserve.errors import ConfigError
from jaxserve.gateway.keys import key_id
from jaxserve.gateway.tenants import hash_key
from jaxserve.entrypoints.http.app import close_app
from jaxserve.entrypoints.http.app_state import STATE_KEY
from tests.test_server import ServerThread, _request, scrape, wait_for

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]
"""
ALICE = {"Authorization": "Bearer sk-alice"}
ADMIN_KEY = "admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture()
def start(tmp_path):
    (tmp_path / "tenants.toml").write_text(TENANTS)
    servers = []

    def start(**config):
        server = ServerThread("tiny", tenants_file=str(tmp_path / "tenants.toml"),
                              audit_log_dir=str(tmp_path / "audit"), **config)
        server.dir = tmp_path / "audit"
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.stop()
        close_app(server.app)


def post(server, path: str, body=None, headers=None):
    return _request("POST", f"{server.url}{path}", body, headers=headers)


def written(server) -> list[dict]:
    audit = server.app[STATE_KEY].policy.audit
    wait_for(lambda: audit.pending == 0, "the audit writer")
    raw = b"".join(p.read_bytes() for p in sorted(server.dir.glob("audit-*.jsonl")))
    return [json.loads(line) for line in raw.splitlines()]


def test_a_wrong_key_flood_is_throttled_and_summarised_per_client(start):
    server = start(auth_failures_per_minute=20)
    codes = [post(server, "/v1/chat/completions", {},
                  {"Authorization": f"Bearer sk-guess-{i}"}).status_code for i in range(60)]
    assert codes[:20] == [401] * 20 and set(codes[20:]) == {429}
    r = post(server, "/v1/chat/completions", {}, ALICE)  # refused before its key is checked
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    audit = server.app[STATE_KEY].policy.audit
    assert [rec for rec in written(server) if rec["type"] == "request"] == []
    audit.write_summaries()  # what the writer does every interval, and on close
    [summary] = [rec for rec in written(server) if rec["type"] != "request"]
    assert summary["type"] == "refusals" and summary["client"] == "127.0.0.1"
    assert summary["tenant"] is None and summary["count"] == 61
    assert summary["statuses"] == {"401_invalid_api_key": 20, "429_rate_limit_exceeded": 41}
    assert summary["routes"] == {"/v1/chat/completions": 61}
    assert len(summary["key_ids"]) == 16 and summary["more_key_ids"] > 0  # bounded
    assert summary["since"] <= summary["ts"]
    audit.write_summaries()  # nothing new: nothing written
    assert len(written(server)) == 1
    assert verify(server.dir).ok


def test_a_full_log_refuses_every_keyed_call_and_warns_first(start, caplog):
    server = start(audit_max_bytes=8192, audit_min_free_bytes=0)
    caplog.set_level(logging.WARNING, logger="jaxserve.audit.log")
    codes = []
    for _ in range(40):  # a known tenant's 404s: one record each, until the log is full
        codes.append(post(server, "/v1/nothing", {}, ALICE).status_code)
        wait_for(lambda: server.app[STATE_KEY].policy.audit.pending == 0, "the writer")
    assert codes[0] == 404 and codes[-1] == 503 and 5 < codes.index(503)
    r = post(server, "/v1/nothing", {}, ALICE)
    assert r.status_code == 503 and "the audit log is full" in r.json()["error"]["message"]
    warned = [rec.getMessage() for rec in caplog.records]
    assert any("audit log is nearly full" in m for m in warned), warned
    assert any("audit log is full" in m for m in warned), warned
    metrics = scrape(server.url)
    assert metrics["jaxserve:audit_log_bytes"] >= 8192 * 0.8
    assert metrics["jaxserve:audit_log_headroom_bytes"] <= 0
    before = len(written(server))
    for _ in range(10):  # its refusals are summarised, not recorded one by one
        assert post(server, "/v1/nothing", {}, ALICE).status_code == 503
    assert len(written(server)) == before
    server.app[STATE_KEY].policy.audit.write_summaries()
    summary = written(server)[-1]
    refused = codes.count(503) + 11
    assert (summary["type"], summary["tenant"], summary["count"], summary["statuses"]) == (
        "refusals", "alice", refused, {"shed": refused})  # the 503 outcome label


def test_admin_calls_are_audited_and_wrong_admin_keys_throttled(start):
    server = start(auth_failures_per_minute=5,
                   setup=lambda app: add_admin_routes(app, None, ADMIN_KEY))
    url = server.url
    assert _request("GET", f"{url}/admin/v1/versions", headers=ADMIN).status_code == 503
    body = {"name": "v9", "model": "smollm2-135m-instruct"}
    assert post(server, "/admin/v1/versions", body, ADMIN).status_code == 503  # warming up
    written(server)  # the writer has caught up: the head is the POST's record
    head = _request("GET", f"{url}/admin/v1/audit/head", headers=ADMIN).json()
    assert head["keyed"] is False
    codes = [_request("DELETE", f"{url}/admin/v1/versions/v9",
                      headers={"Authorization": f"Bearer guess-{i}"}).status_code
             for i in range(8)]
    assert codes == [401] * 5 + [429] * 3
    assert _request("GET", f"{url}/admin/v1/versions", headers=ADMIN).status_code == 429
    server.app[STATE_KEY].policy.audit.write_summaries()
    records = written(server)
    admin = [r for r in records if r["type"] == "admin"]
    assert [(r["method"], r["route"], r["status_code"], r["key_id"], r["client"])
            for r in admin] == [
        ("GET", "/admin/v1/versions", 503, key_id(hash_key(ADMIN_KEY)), "127.0.0.1"),
        ("POST", "/admin/v1/versions", 503, key_id(hash_key(ADMIN_KEY)), "127.0.0.1"),
        ("GET", "/admin/v1/audit/head", 200, key_id(hash_key(ADMIN_KEY)), "127.0.0.1")]
    assert admin[1]["body"] == body and admin[0]["body"] is None
    [summary] = [r for r in records if r["type"] == "refusals"]
    assert summary["statuses"] == {"401_invalid_api_key": 5, "429_rate_limit_exceeded": 4}
    assert summary["routes"] == {"/admin/v1/versions/v9": 8, "/admin/v1/versions": 1}
    # the head it exported (before its own record) is in the chain, with its hash
    assert head["seq"] == admin[1]["seq"] and head["hash"] == admin[1]["hash"]
    assert verify(server.dir, head=(head["seq"], head["hash"])).ok


def test_an_unguarded_admin_route_is_refused_at_start():
    async def naked(request):
        return web.json_response({})

    async def main():
        from jaxserve.config import ServerConfig
        from jaxserve.entrypoints.http.app import build_app
        from aiohttp.test_utils import TestServer

        app = build_app(ServerConfig(port=0), "unused")
        add_admin_routes(app, None, ADMIN_KEY)
        app.router.add_get("/admin/v1/naked", naked)
        with pytest.raises(ConfigError, match="/admin/v1/naked is not behind the admin key"):
            await TestServer(app).start_server()

    import asyncio
    asyncio.run(main())


def test_the_admin_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    import argparse

    monkeypatch.delenv("JAXSERVE_ADMIN_KEY", raising=False)
    ns = argparse.Namespace
    assert admin_key(ns(admin_key=None, admin_key_file=None)) is None
    (tmp_path / "key").write_text(ADMIN_KEY + "\n")
    assert admin_key(ns(admin_key=None, admin_key_file=tmp_path / "key")) == ADMIN_KEY
    monkeypatch.setenv("JAXSERVE_ADMIN_KEY", "from-the-environment")
    assert admin_key(ns(admin_key=None, admin_key_file=None)) == "from-the-environment"
    with pytest.raises(ConfigError, match="one of"):
        admin_key(ns(admin_key="k", admin_key_file=tmp_path / "key"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        admin_key(ns(admin_key=None, admin_key_file=tmp_path / "empty"))


def test_grpc_wrong_keys_are_throttled_per_address_not_per_connection(tmp_path):
    from types import SimpleNamespace

    from jaxserve.entrypoints.grpc import GenerationService
    from jaxserve.errors import RateLimitExceeded, Unauthenticated
    from jaxserve.gateway import Gateway
    from jaxserve.gateway.tenants import load_tenants

    (tmp_path / "tenants.toml").write_text(TENANTS)
    gateway = Gateway(load_tenants(tmp_path / "tenants.toml"), auth_failures_per_minute=3)
    service = GenerationService(SimpleNamespace(gateway=gateway))

    def context(port: int, key: str):  # each call on a new connection: a new port
        return SimpleNamespace(peer=lambda: f"ipv4:127.0.0.1:{port}",
                               invocation_metadata=lambda: (("authorization", f"Bearer {key}"),))
    for port in range(3):
        with pytest.raises(Unauthenticated):
            service._principal(context(port, "guess"))
    with pytest.raises(RateLimitExceeded):
        service._principal(context(9, "sk-alice"))
    other = SimpleNamespace(peer=lambda: "ipv6:[::1]:5",
                            invocation_metadata=lambda: (("authorization", "Bearer sk-alice"),))
    assert service._principal(other).tenant.name == "alice"

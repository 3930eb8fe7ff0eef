"""Who can reach a server, and from where (review a70e490, M2 and M10), on real servers bound to
127.0.0.1 (no engine: the RAG routes with the tiny encoder, /metrics and the probes answer
without one):

- an open server (no --tenants) refuses to bind beyond loopback unless --allow-unauthenticated;
- a JSON route refuses a body that is not declared JSON (415 naming Content-Type), so a web
  page's no-cors `text/plain` POST (CSRF) writes nothing;
- an open server answers only Host names that are loopback, IP literals or --allowed-hosts (DNS
  rebinding), and refuses a browser's cross-site Origin (CSRF);
- /metrics (every tenant's names, traffic and spend) takes a bearer token, and on a server with
  tenants but no token answers loopback clients only."""

from __future__ import annotations

import asyncio
import re
import logging
from unittest import mock

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import make_mocked_request

from jaxserve.config import ServerConfig
from jaxserve.entrypoints import cli, launcher
from jaxserve.entrypoints.http.app import build_app, start_server
from jaxserve.entrypoints.http.rag_routes import add_rag_routes
from jaxserve.errors import ConfigError
from tests.test_rag_http import service  # noqa: F401 - the fixture: a RagService, tiny encoder

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice-0123456789"]
"""


def _serve(scenario, rag=None, **config):
    """Run `scenario(session, url)` against a server on 127.0.0.1 (a free port), then stop it."""
    async def main():
        app = build_app(ServerConfig(port=0, **config), "m")
        if rag is not None:
            add_rag_routes(app, rag)
        runner, port = await start_server(app, "127.0.0.1", 0)
        try:
            async with ClientSession() as session:
                return await scenario(session, f"http://127.0.0.1:{port}", port)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


async def _status(session, method, url, *, data=None, json=None, headers=None):
    async with session.request(method, url, data=data, json=json, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


# --- M2: binding beyond loopback without keys ---

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com", ""])
def test_open_server_refuses_a_non_loopback_bind(capsys, host):
    rc = cli.main(["serve", "--model", "no-such-model", "--host", host])
    err = capsys.readouterr().err
    assert rc == 1 and "--allow-unauthenticated" in err and "--tenants" in err, err


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_open_server_on_loopback_starts_with_a_warning(caplog, host):
    caplog.set_level(logging.WARNING, logger="jaxserve.server")
    launcher.check_exposure(host, tenants=None, allow_unauthenticated=False)
    assert "no --tenants" in caplog.text


def test_keys_or_the_explicit_flag_allow_any_bind(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="jaxserve.server")
    launcher.check_exposure("0.0.0.0", tenants=tmp_path / "t.toml", allow_unauthenticated=False)
    assert caplog.text == ""
    launcher.check_exposure("0.0.0.0", tenants=None, allow_unauthenticated=True)
    assert "UNAUTHENTICATED" in caplog.text and "0.0.0.0" in caplog.text
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        launcher.check_exposure("0.0.0.0", tenants=None, allow_unauthenticated=False)


# --- M2: a browser's writes (CSRF) ---

def test_a_text_plain_post_is_415_and_writes_nothing(service):  # noqa: F811
    async def scenario(s, url, port):
        # What a web page can send without a CORS preflight: text/plain (and no type at all).
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-"
                                                                         "urlencoded"}, {}):
            status, body = await _status(s, "POST", f"{url}/v1/collections",
                                         data=b'{"name": "kb"}', headers=headers)
            assert status == 415, (headers, body)
            assert "Content-Type" in body["error"]["message"]
            assert body["error"]["code"] == "unsupported_media_type"
        assert (await _status(s, "GET", f"{url}/v1/collections"))[1]["data"] == []
        for content_type in ("application/json", "application/json; charset=utf-8"):
            status, _ = await _status(s, "POST", f"{url}/v1/collections",
                                      data=b'{"name": "kb%d"}' % len(content_type),
                                      headers={"Content-Type": content_type})
            assert status == 201, content_type
    _serve(scenario, rag=service)


def test_open_server_refuses_foreign_host_and_origin():
    async def scenario(s, url, port):
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
            status, body = await _status(s, "GET", f"{url}/health", headers={"Host": host})
            assert status == 403 and "Host" in body["error"]["message"], host
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "10.0.0.7",
                     "api.internal:80"):
            assert (await _status(s, "GET", f"{url}/health", headers={"Host": host}))[0] == 200
        for origin in ("https://evil.example", "null", f"http://evil.example:{port}"):
            status, body = await _status(s, "GET", f"{url}/v1/models",
                                         headers={"Origin": origin})
            assert status == 403 and "Origin" in body["error"]["message"], origin
        for origin in (f"http://localhost:{port}", "http://127.0.0.1:3000",
                       "https://api.internal"):
            # allowed: no 403 (503: the server has no engine)
            assert (await _status(s, "GET", f"{url}/v1/models",
                                  headers={"Origin": origin}))[0] == 503, origin
    _serve(scenario, allowed_hosts=("api.internal",))


def test_a_server_with_keys_leaves_host_and_origin_to_the_keys(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)

    async def scenario(s, url, port):
        headers = {"Host": "evil.example", "Origin": "https://evil.example"}
        assert (await _status(s, "GET", f"{url}/v1/models", headers=headers))[0] == 401
    _serve(scenario, tenants_file=str(path))


def test_allowed_hosts_star_turns_the_check_off():
    async def scenario(s, url, port):
        headers = {"Host": "evil.example", "Origin": "https://evil.example"}
        assert (await _status(s, "GET", f"{url}/health", headers=headers))[0] == 200
    _serve(scenario, allowed_hosts=("*",))


# --- M10: /metrics ---

def test_metrics_take_the_bearer_token():
    async def scenario(s, url, port):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-tok"}):
            async with s.get(f"{url}/metrics", headers=headers) as resp:
                assert resp.status == 401, headers
                assert "jaxserve:" not in await resp.text()
        async with s.get(f"{url}/metrics",
                         headers={"Authorization": "Bearer secret-tok"}) as resp:
            assert resp.status == 200 and "jaxserve:" in await resp.text()
        assert (await _status(s, "GET", f"{url}/health"))[0] == 200  # probes stay open
    _serve(scenario, metrics_token="secret-tok")


def _metrics_from(app: web.Application, peer: str) -> int:
    from jaxserve.entrypoints.http.app import metrics

    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default)
    request = make_mocked_request("GET", "/metrics", app=app, transport=transport)
    try:
        return asyncio.run(metrics(request)).status
    except Exception as exc:  # noqa: BLE001 - the typed error the front door would map
        from jaxserve.errors import error_status

        return error_status(exc).http


def test_metrics_of_a_server_with_tenants_and_no_token_answer_loopback_only(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    app = build_app(ServerConfig(port=0, tenants_file=str(path)), "m")
    assert _metrics_from(app, "127.0.0.1") == 200
    assert _metrics_from(app, "10.0.0.9") == 403
    # An open server has no tenants to hide: its metrics stay open.
    assert _metrics_from(build_app(ServerConfig(port=0), "m"), "10.0.0.9") == 200


def test_metrics_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    token_file = tmp_path / "metrics-token"
    token_file.write_text("tok-from-file\n")
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--metrics-token-file", str(token_file)])
    config = launcher.server_config(args)
    assert config.metrics_token == "tok-from-file" and "tok-from-file" not in repr(config)
    monkeypatch.setenv("JAXSERVE_METRICS_TOKEN", "tok-from-env")
    args = parser.parse_args(["serve", "--model", "m"])
    assert launcher.server_config(args).metrics_token == "tok-from-env"
    token_file.write_text("\n")
    args = parser.parse_args(["serve", "--model", "m", "--metrics-token-file", str(token_file)])
    with pytest.raises(ConfigError, match="metrics-token-file"):
        launcher.server_config(args)


# --- L5: a 500 tells the client nothing of the server's insides ---

def test_an_internal_error_is_a_generic_500(service, monkeypatch, caplog):  # noqa: F811
    secret = "/srv/jaxserve/rag/tenants.sqlite: disk I/O error"
    monkeypatch.setattr(service, "create_collection",
                        mock.Mock(side_effect=OSError(secret)))

    async def scenario(s, url, port):
        return await _status(s, "POST", f"{url}/v1/collections", json={"name": "kb"})
    status, body = _serve(scenario, rag=service)
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "/srv" not in body["error"]["message"] and "OSError" not in body["error"]["message"]
    assert secret in caplog.text  # the log has it


def test_hashed_tenant_labels(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)

    async def scenario(s, url, port):
        await _status(s, "GET", f"{url}/v1/models",
                      headers={"Authorization": "Bearer sk-alice-0123456789"})
        await _status(s, "GET", f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
        async with s.get(f"{url}/metrics") as resp:
            return await resp.text()
    text = _serve(scenario, tenants_file=str(path), metrics_tenant_labels="hashed")
    tenants = set(re.findall(r'tenant="([^"]*)"', text))
    assert "alice" not in tenants and "none" in tenants  # no key matched: no tenant to hide
    (alias,) = tenants - {"none"}
    assert re.fullmatch(r"t-[0-9a-f]{12}", alias)
    # the same alias after a restart (series continue), from the tenants' keys
    assert alias in _serve(scenario, tenants_file=str(path), metrics_tenant_labels="hashed")

"""The fleet's eval gate (`[route.X.gate] eval = "suite.toml"`): a route's weight on a version grows
only when the suite's stored results show that version passed (every task run, no regression
against the version before it). The fleet with fake engines (tests/test_fleet.py), a real results
store, and the admin API's PUT over HTTP; and once end to end, over a real `jaxserve serve`
deployment that `jaxserve eval run` evaluates."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.errors import Conflict, InvalidRequest
from jaxserve.evals.gate import eval_gate_refusal
from jaxserve.evals.store import ResultsStore, Run, Sample
from jaxserve.fleet.deployment import parse_deployment, parse_route
from tests.test_fleet import ready_fleet

SUITE = """
name = "gate"
store = "evals.sqlite"
[[tasks]]
name = "qa"
[[versions]]
name = "a"
url = "http://127.0.0.1:1/v1"
model = "a"
[[versions]]
name = "b"
url = "http://127.0.0.1:1/v1"
model = "b"
"""


def _store_run(path, version: str, correct: list[float]) -> None:
    with ResultsStore(str(path)) as store:
        samples = [Sample(i, f"h{i}", c, "t", "r") for i, c in enumerate(correct)]
        store.add_run(Run(f"{version}-{sum(correct)}", "gate", version, version, "qa", "acc",
                          sum(correct) / len(correct), len(correct), 1, {}, 1.0, 2.0), samples)


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    return path


def _gated_fleet(suite):
    fleet = ready_fleet("a", "b", eval_gate=eval_gate_refusal)
    first = fleet.set_route(parse_route("r", {"weights": {"a": 100, "b": 0},
                                              "gate": {"eval": str(suite)}}))
    assert first.to_dict()["gate"] == {"eval": str(suite)}
    return fleet, first


def test_weight_grows_only_after_the_suite_passed(suite, tmp_path):
    fleet, first = _gated_fleet(suite)
    grow = parse_route("r", {"weights": {"a": 90, "b": 10}}, base=first)
    with pytest.raises(Conflict, match="no stored run of 'b' on 'qa'") as e:
        fleet.set_route(grow)
    assert e.value.param == "weights.b" and fleet.route("r") == first
    _store_run(tmp_path / "evals.sqlite", "a", [1.0] * 40)
    _store_run(tmp_path / "evals.sqlite", "b", [1.0] * 30 + [0.0] * 10)  # 25 points lost
    with pytest.raises(Conflict, match=r"regressed on 'qa'.*25.00 points below 'a' \(p = "):
        fleet.set_route(grow)
    _store_run(tmp_path / "evals.sqlite", "b", [1.0] * 39 + [0.0])  # a newer run: 1 lost, noise
    assert fleet.set_route(grow).weight("b") == 10
    # Shrinking a weight, or a route with no gate, is never held.
    assert fleet.set_route(parse_route("r", {"weights": {"a": 100, "b": 0}}, base=grow))
    ungated = parse_route("r", {"weights": {"a": 50, "b": 50}, "gate": False},
                          base=fleet.route("r"))
    assert fleet.set_route(ungated).eval_gate is None


def test_the_admin_api_answers_409_until_the_suite_passed(suite, tmp_path):
    """PUT /admin/v1/routes/{route} on a real HTTP server: the gate's refusal is a 409 naming
    the weight and why; once the stored runs pass, the same PUT is a 200."""
    from aiohttp.test_utils import TestClient, TestServer

    from jaxserve.config import ServerConfig
    from jaxserve.entrypoints.http.admin_routes import add_admin_routes
    from jaxserve.entrypoints.http.app import build_app

    fleet, _ = _gated_fleet(suite)
    auth = {"Authorization": "Bearer admin-key"}
    grow = {"weights": {"a": 90, "b": 10}}

    async def main():
        app = build_app(ServerConfig(port=0), "unused")
        add_admin_routes(app, fleet, "admin-key")
        async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
            r = await client.put("/admin/v1/routes/r", json=grow, headers=auth)
            error = (await r.json())["error"]
            assert r.status == 409 and error["param"] == "weights.b", error
            assert "may not grow: eval suite 'gate' has no stored run of 'b'" in error["message"]
            _store_run(tmp_path / "evals.sqlite", "a", [1.0] * 40)
            _store_run(tmp_path / "evals.sqlite", "b", [1.0] * 30 + [0.0] * 10)
            r = await client.put("/admin/v1/routes/r", json=grow, headers=auth)
            error = (await r.json())["error"]
            assert r.status == 409 and "regressed on 'qa'" in error["message"], error
            listed = await (await client.get("/admin/v1/routes", headers=auth)).json()
            assert [dict(x["weights"]) for x in listed["data"]] == [{"a": 100.0, "b": 0.0}]
            _store_run(tmp_path / "evals.sqlite", "b", [1.0] * 39 + [0.0])
            r = await client.put("/admin/v1/routes/r", json=grow, headers=auth)
            assert r.status == 200, await r.text()
            assert (await r.json())["weights"] == {"a": 90.0, "b": 10.0}

    asyncio.run(main())
    fleet.shutdown()


def test_a_version_outside_the_suite_or_a_broken_suite_is_held(suite, tmp_path):
    assert "has no version 'c'" in eval_gate_refusal(str(suite), "c")
    assert "cannot read" in eval_gate_refusal(str(tmp_path / "missing.toml"), "a")
    fleet = ready_fleet("a", "b")  # no gate wired: a gated route cannot grow
    first = fleet.set_route(parse_route("r", {"weights": {"a": 1, "b": 0},
                                              "gate": {"eval": str(suite)}}))
    with pytest.raises(Conflict, match="no eval gate"):
        fleet.set_route(parse_route("r", {"weights": {"b": 1}}, base=first))


def test_the_deployment_file_takes_a_gate():
    deployment = parse_deployment({"version": {"a": {"model": "m"}},
                                   "route": {"r": {"weights": {"a": 1},
                                                   "gate": {"eval": "suite.toml"}}}})
    assert deployment.routes[0].eval_gate == "suite.toml"
    with pytest.raises(InvalidRequest, match=r"'route.r.gate.eval' must be the path"):
        parse_deployment({"version": {"a": {"model": "m"}},
                          "route": {"r": {"weights": {"a": 1}, "gate": {"eval": 3}}}})
    with pytest.raises(InvalidRequest, match=r"'route.r.gate.evals' is not a known field"):
        parse_deployment({"version": {"a": {"model": "m"}},
                          "route": {"r": {"weights": {"a": 1}, "gate": {"evals": "x"}}}})


@pytest.mark.slow
def test_a_served_deployment_holds_the_weight_until_an_eval_run_passes(
        tmp_path, smollm2_tokenizer_fields, capsys):
    """End to end: `jaxserve serve --deployment` with two versions of a tiny model behind a gated
    route, `jaxserve eval run` against it (version a on the live route, b through the Batch API),
    and the admin API's PUT raising b's weight: a 409 before the run, a 200 after it."""
    pytest.importorskip("lm_eval")
    import shutil

    from jaxserve.entrypoints.cli import main
    from jaxserve.entrypoints.process import ServerProcess
    from tests.test_cli import ROOT, tiny_gguf
    from tests.test_server import _request, wait_for

    model = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    engine = ('max_model_len = 128\nnum_pages = 32\nmax_num_seqs = 4\n'
              'max_num_batched_tokens = 32\nmin_token_bucket = 16\ndeterministic = true\n')
    suite = tmp_path / "suite.toml"
    deployment = tmp_path / "deployment.toml"
    deployment.write_text(f'[version.a]\nmodel = "{model}"\n{engine}'
                          f'[version.b]\nmodel = "{model}"\n{engine}'
                          f'[route.r]\nweights = {{ a = 100, b = 0 }}\n'
                          f'[route.r.gate]\neval = "{suite}"\n')
    admin = {"Authorization": "Bearer admin-key"}
    grow = {"weights": {"a": 90, "b": 10}}
    with (tmp_path / "server.log").open("w") as log:
        server = ServerProcess(["--deployment", str(deployment), "--admin-key", "admin-key",
                                "--no-rag", "--port", "0", "--data-dir", str(tmp_path / "data")],
                               log, cwd=ROOT)
        try:
            base = server.url.removesuffix("/v1")
            wait_for(lambda: _request("GET", f"{base}/ready").status_code == 200, "ready", 300)
            shutil.copytree(ROOT / "configs" / "evals" / "tasks", tmp_path / "tasks")
            version = f'url = "{server.url}"\nmax_gen_toks = 8\n'
            suite.write_text(f'name = "gate"\nlimit = 8\n[[tasks]]\npath = "tasks/capitals.yaml"\n'
                             f'[[versions]]\nname = "a"\nmodel = "a"\n{version}'
                             f'[[versions]]\nname = "b"\nmodel = "b"\nvia = "batch"\n{version}')
            reply = _request("PUT", f"{base}/admin/v1/routes/r", grow, headers=admin)
            error = reply.json()["error"]
            assert reply.status_code == 409 and error["param"] == "weights.b", error
            assert "has no stored run of 'b'" in error["message"]
            assert main(["eval", "run", str(suite)]) == 0, capsys.readouterr().err[-2000:]
            assert "submitted batch" in capsys.readouterr().err
            reply = _request("PUT", f"{base}/admin/v1/routes/r", grow, headers=admin)
            assert reply.status_code == 200 and reply.json()["weights"] == {"a": 90.0, "b": 10.0}
            assert server.stop() == 0
        finally:
            server.kill()

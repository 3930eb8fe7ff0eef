"""`jaxserve eval run` serving its suite's versions itself (jaxserve/entrypoints/eval_versions.py):
one version given as a model path with engine settings, one as a deployment file's version, each
loaded in-process behind the HTTP app for its pairs, lm-eval's `local-completions` scoring the
multiple-choice example task against it. Both run `deterministic`, one with one request in flight
and one prompt per request, the other with 8 in flight of 4 prompts each: every question's
log-likelihoods must come back bit-identical. Each run is stored under the version's manifest id
(known before loading: the re-run resumes every pair without loading an engine)."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve.entrypoints.cli import main
from jaxserve.entrypoints.eval_versions import InProcessVersions, fleet_version
from jaxserve.errors import ConfigError, InvalidRequest
from jaxserve.evals.store import open_store
from jaxserve.evals.suite import load_suite
from tests.test_cli import ROOT, tiny_gguf

pytest.importorskip("lm_eval")
TASK = ROOT / "configs" / "evals" / "tasks" / "capitals_mc.yaml"
# One token bucket (deterministic) of 32 tokens: one forward program to compile per version.
ENGINE = ("max_model_len = 128, max_num_seqs = 4, max_num_batched_tokens = 32, "
          "num_pages = 48, deterministic = true")


@pytest.fixture
def suite(tmp_path, smollm2_tokenizer_fields):
    tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=128)
    shutil.copytree(TASK.parent, tmp_path / "tasks")
    (tmp_path / "deploy.toml").write_text(f"""
[version.tiny-dep]
model = "{tmp_path / 'tiny.gguf'}"
{ENGINE.replace(", ", chr(10))}
""")
    path = tmp_path / "suite.toml"
    path.write_text(f"""
name = "in-process"
limit = 6
[[tasks]]
path = "tasks/capitals_mc.yaml"
[[versions]]
name = "tiny-path"
path = "tiny.gguf"
engine = {{{ENGINE}}}
num_concurrent = 1
[[versions]]
name = "tiny-dep"
deployment = "deploy.toml"
num_concurrent = 8
batch_size = 4
""")
    return path


def test_path_and_deployment_versions_run_in_process(suite, tmp_path, capsys, monkeypatch):
    assert main(["eval", "run", str(suite)]) == 0  # the same weights: no regression
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loaded = load_suite(suite)
    ids = {v.name: InProcessVersions().version_id(v) for v in loaded.versions}
    assert all(i.startswith("fp_") for i in ids.values()) and len(set(ids.values())) == 1
    assert {r["version"]: r["version_id"] for r in report["runs"]} == ids
    with open_store(str(tmp_path / "evals.sqlite")) as store:
        runs = {r.version: r for r in store.runs("in-process")}
        samples = {v: store.samples(r.id) for v, r in runs.items()}
    assert runs["tiny-path"].settings["engine"]["deterministic"] is True
    assert runs["tiny-dep"].settings["deployment"] == str(tmp_path / "deploy.toml")
    # lm-eval's per-choice (log-likelihood, is_greedy) of each question, as stored: equal to
    # the last bit between one prompt at a time and 8 requests of 4 prompts in flight.
    path_answers = [s.response for s in samples["tiny-path"]]
    assert len(path_answers) == 6 and all("(-" in a for a in path_answers)
    assert path_answers == [s.response for s in samples["tiny-dep"]]
    (comparison,) = report["comparisons"]
    assert comparison["drop_points"] == 0 and not comparison["alert"]

    # Stored: a re-run finds every pair by the manifest ids and loads nothing.
    monkeypatch.setattr(InProcessVersions, "serve", None)
    assert main(["eval", "run", str(suite)]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(r["resumed"] for r in again["runs"])


def test_a_deployment_without_the_version_or_a_bad_setting_is_an_error(suite, tmp_path):
    loaded = load_suite(suite)
    path_version, dep_version = loaded.versions
    assert fleet_version(dep_version).model == str(tmp_path / "tiny.gguf")
    with pytest.raises(ConfigError, match=r"has no \[version.tiny-path\]"):
        fleet_version(type(dep_version)(**{**dep_version.__dict__, "name": "tiny-path"}))
    bad = type(path_version)(**{**path_version.__dict__,
                                "engine": (("max_num_seqs", "four"),)})
    with pytest.raises(InvalidRequest, match="engine.max_num_seqs"):
        fleet_version(bad)

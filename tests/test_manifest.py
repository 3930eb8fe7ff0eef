"""Version manifests: content-addressed ids over weights, tokenizer, chat template, generation
defaults, output-changing engine settings and price; the (path, size, mtime) hash cache;
`jaxserve manifest` on the command line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from jaxserve.entrypoints import cli
from jaxserve.fleet import manifest as manifest_mod
from jaxserve.fleet.deployment import VersionSpec
from jaxserve.fleet.manifest import FileHashCache, manifest_of
from jaxserve.gateway.pricing import Pricing
from tests.test_weights import random_params, tiny, write_gguf

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def small_vocab_gguf(path: Path, seed: int = 0) -> Path:
    """A random tiny model with a 64-token vocabulary of its own (one printable character each):
    its metadata reads in milliseconds, where SmolLM2's 49k-token tokenizer takes seconds."""
    config = tiny()

    def add_tokenizer(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([chr(33 + i) for i in range(config.vocab_size)])
        w.add_token_merges([])
        w.add_token_types([1] * config.vocab_size)
        w.add_chat_template(CHAT_TEMPLATE)

    return write_gguf(path, config, random_params(config, seed), add_metadata=add_tokenizer)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return small_vocab_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
def hashes(tmp_path) -> FileHashCache:
    return FileHashCache(tmp_path / "hashes.json")


def _spec(model, **kw) -> VersionSpec:
    generation = tuple(sorted(kw.pop("generation", {}).items()))
    dtype = kw.pop("dtype", None)
    pricing = kw.pop("pricing", None)
    return VersionSpec("v", str(model), dtype, tuple(sorted(kw.items())), generation, pricing)


def test_the_id_covers_contents_and_settings_but_not_paths(tiny_path, tmp_path, hashes):
    base = manifest_of(_spec(tiny_path), hashes)
    d = base.to_dict()
    assert d["id"].startswith("fp_") and len(d["id"]) == 19
    assert d["weights"] == [{"path": "tiny.gguf", "bytes": tiny_path.stat().st_size,
                             "sha256": hashlib.sha256(tiny_path.read_bytes()).hexdigest()}]
    assert d["tokenizer"]["files"][0]["sha256"] == d["weights"][0]["sha256"]  # in the GGUF
    assert d["tokenizer"]["chat_template_sha256"] is not None
    assert d["engine"] == {"dtype": "float32", "kv_cache_dtype": "float32", "max_model_len": 128}
    assert manifest_of(_spec(tiny_path), hashes).id == base.id  # deterministic
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_path, copy)
    assert manifest_of(_spec(copy), hashes).id == base.id  # same bytes, same version
    ids = {manifest_of(s, hashes).id for s in (
        _spec(tiny_path, max_model_len=64), _spec(tiny_path, dtype="bfloat16"),
        _spec(tiny_path, generation={"temperature": 0.5}),
        _spec(tiny_path, generation={"system_prompt": "Be brief."}),
        _spec(tiny_path, pricing=Pricing(0.1, 0.2)))}
    assert len(ids) == 5 and base.id not in ids
    # settings that do not change outputs do not change the version
    assert manifest_of(_spec(tiny_path, max_num_seqs=3, page_size=32), hashes).id == base.id
    with copy.open("r+b") as f:  # one byte of the weights
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert manifest_of(_spec(copy), hashes).id != base.id


def test_hashes_are_cached_by_path_size_and_mtime(tiny_path, tmp_path, monkeypatch):
    calls = []
    real = manifest_mod.sha256_of
    monkeypatch.setattr(manifest_mod, "sha256_of", lambda p: calls.append(p) or real(p))
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_path, path)
    cache_file = tmp_path / "hashes.json"
    first = manifest_of(_spec(path), FileHashCache(cache_file)).id
    assert len(calls) == 1  # the GGUF is both weights and tokenizer: hashed once
    # a restart (a new cache object reading the same file) re-hashes nothing
    assert manifest_of(_spec(path), FileHashCache(cache_file)).id == first and len(calls) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert manifest_of(_spec(path), FileHashCache(cache_file)).id == first and len(calls) == 2


def test_orbax_manifest_lists_the_checkpoint_files(tiny_path, tmp_path, hashes):
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import tokenizer_source
    from jaxserve.weights import load_model
    from jaxserve.weights.checkpoint import save_checkpoint

    spec = resolve(str(tiny_path))
    config, params = load_model(spec)
    save_checkpoint(tmp_path / "ckpt", config, params, tokenizer_source(spec))
    d = manifest_of(_spec(tmp_path / "ckpt"), hashes).to_dict()
    paths = [w["path"] for w in d["weights"]]
    assert "jaxserve_model.json" in paths and any(p.startswith("params/") for p in paths)
    assert d["format"] == "orbax" and d["tokenizer"]["files"][0]["path"] == "tiny.gguf"
    assert d["id"] != manifest_of(_spec(tiny_path), hashes).id


def test_price_comes_from_the_model_config_unless_the_version_sets_one(tiny_path, tmp_path,
                                                                       monkeypatch, hashes):
    configs, cache = tmp_path / "configs", tmp_path / "cache"
    configs.mkdir()
    (configs / "priced.toml").write_text(
        'name = "priced"\nformat = "gguf"\n[source]\npypi = "x==1"\nfile = "x/tiny.gguf"\n'
        'sha256 = "0"\n[pricing]\nprompt_per_1m = 0.15\ncompletion_per_1m = 0.6\n')
    (cache / "models" / "priced").mkdir(parents=True)
    shutil.copy(tiny_path, cache / "models" / "priced" / "tiny.gguf")
    monkeypatch.setenv("JAXSERVE_CONFIGS", str(configs))
    monkeypatch.setenv("JAXSERVE_CACHE", str(cache))
    assert manifest_of(_spec("priced"), hashes).to_dict()["pricing"] == {
        "prompt_per_1m": 0.15, "completion_per_1m": 0.6}
    own = manifest_of(_spec("priced", pricing=Pricing(1.0, 2.0)), hashes).to_dict()
    assert own["pricing"] == {"prompt_per_1m": 1.0, "completion_per_1m": 2.0}


def test_bad_settings_name_the_field(tiny_path, hashes):
    from jaxserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="max_model_len 4096 exceeds") as e:
        manifest_of(_spec(tiny_path, max_model_len=4096), hashes)
    assert e.value.param == "max_model_len"
    with pytest.raises(InvalidRequest) as e:
        manifest_of(_spec(tiny_path, generation={"temperature": -1.0}), hashes)
    assert e.value.param == "generation.temperature"


def test_manifest_command_prints_json(tiny_path, capsys):
    assert cli.main(["manifest", str(tiny_path), "--max-model-len", "64"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine"]["max_model_len"] == 64 and printed["id"].startswith("fp_")
    assert cli.main(["manifest", "no-such-model"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_a_deployment_with_bad_values_fails_before_anything_loads(tiny_path, tmp_path):
    from jaxserve.errors import ConfigError
    from jaxserve.fleet.fleet import Fleet
    from jaxserve.fleet.loader import EngineLoader

    path = tmp_path / "deploy.toml"
    for body, field in (("generation = { temperature = -1.0 }", "version.b.generation.temperature"),
                        ("max_model_len = 4096", "version.b.max_model_len")):
        path.write_text(f'[version.a]\nmodel = "{tiny_path}"\n'
                        f'[version.b]\nmodel = "{tiny_path}"\n{body}\n')
        with pytest.raises(ConfigError, match=f"^{path}: {field}: "):
            Fleet.from_deployment(path, EngineLoader(hashes=FileHashCache(tmp_path / "h.json")))
    path.write_text('[version.a]\nmodel = "no-such-model"\n')
    with pytest.raises(ConfigError, match="version.a.model: unknown model 'no-such-model'"):
        Fleet.from_deployment(path, EngineLoader(hashes=FileHashCache(tmp_path / "h.json")))

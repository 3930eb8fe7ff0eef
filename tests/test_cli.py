"""`jaxserve` CLI: greedy generation equals the HF golden tokens; errors are one line, exit code 1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.entrypoints import cli
from jaxserve.weights import load_model
from jaxserve.model_registry import ModelSpec
from tests.test_weights import assert_same_tree, random_params, tiny, write_gguf

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(rc: int, err: str, match: str):
    assert rc == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in err


# ---------------------------------------------------------------- tiny models with a real tokenizer


# A tiny GGUF's arguments (digest) -> a private copy of the file they wrote. The same arguments
# write the same bytes (fixed seed), and writing SmolLM2's 49k tokens and merges takes seconds,
# so later calls copy the first file (a private copy: a test may corrupt its own file), kept in
# a directory removed when the process exits.
_TINY_GGUFS: dict[str, Path] = {}
_TINY_GGUF_DIR = tempfile.TemporaryDirectory(prefix="jaxserve-tiny-ggufs-")


def tiny_gguf(path: Path, fields: dict | None, *, chat_template: bool = True,
              arch: str | None = None, **config_changes) -> Path:
    """A random 2-layer model carrying SmolLM2's tokenizer (so prompts encode for real);
    config_changes override `tiny()`'s fields (e.g. a longer max_position_embeddings)."""
    key = hashlib.sha256(json.dumps([fields, chat_template, arch, config_changes],
                                    sort_keys=True, default=repr).encode()).hexdigest()
    if key in _TINY_GGUFS:
        shutil.copyfile(_TINY_GGUFS[key], path)
        return path
    _write_tiny_gguf(path, fields, chat_template, arch, config_changes)
    _TINY_GGUFS[key] = Path(_TINY_GGUF_DIR.name) / f"{key}.gguf"
    shutil.copyfile(path, _TINY_GGUFS[key])
    return path


def _write_tiny_gguf(path: Path, fields: dict | None, chat_template: bool, arch: str | None,
                     config_changes: dict) -> Path:
    config = tiny(vocab_size=49152 if fields else 64, **config_changes)

    def add_tokenizer(w):
        if fields is None:
            return
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(fields["tokenizer.ggml.tokens"])
        w.add_token_merges(fields["tokenizer.ggml.merges"])
        w.add_token_types(fields["tokenizer.ggml.token_type"])
        if chat_template:
            w.add_chat_template(fields["tokenizer.chat_template"])

    return write_gguf(path, config, random_params(config), arch=arch, add_metadata=add_tokenizer)


# ---------------------------------------------------------------- golden


@pytest.mark.slow
def test_generate_json_subprocess_matches_golden(smollm2_path, smollm2_golden):
    chat = smollm2_golden["cases"][0]
    assert chat["case"]["messages"][0]["role"] == "user" and len(chat["case"]["messages"]) == 1
    proc = run_cli("generate", "--model", SMOLLM2, "--chat", "--prompt",
                   chat["case"]["messages"][0]["content"], "--max-tokens", "32", "--temperature",
                   "0", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompt_token_ids"] == chat["input_ids"]
    assert result["token_ids"] == chat["greedy_ids"]
    assert result["text"].startswith("The capital of France is Paris.")
    assert result["finish_reason"] == "stop"

    raw = smollm2_golden["cases"][5]
    proc = run_cli("generate", "--model", SMOLLM2, "--prompt-token-ids",
                   ",".join(map(str, raw["input_ids"])), "--max-tokens", "32", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == raw["greedy_ids"]


# ---------------------------------------------------------------- bad input


def test_unknown_model_subprocess_is_one_line_exit_1():
    proc = run_cli("generate", "--model", "no-such-model", "--prompt", "hi", timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "unknown model 'no-such-model'")


@pytest.mark.parametrize("argv, match", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt-token-ids", ""], "the prompt is empty"),
    (["--prompt-token-ids", "1,x"], "comma-separated integers"),
    (["--prompt-token-ids", "1", "--chat"], "--chat needs --prompt"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
])
def test_bad_arguments_fail_before_loading(capsys, argv, match):
    rc = cli.main(["generate", "--model", "no-such-model-either", *argv])
    assert_one_line_error(rc, capsys.readouterr().err, match)


def test_bad_weights(tmp_path, capsys):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    rc = cli.main(["generate", "--model", str(garbage), "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, f"{garbage}: not a readable GGUF file")

    bert = tiny_gguf(tmp_path / "bert.gguf", None, arch="bert")
    rc = cli.main(["generate", "--model", str(bert), "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, "unsupported GGUF architecture 'bert'")

    rc = cli.main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, "unknown model")

    rc = cli.main(["generate", "--model", "all-minilm-l6-v2", "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, "not a generative (Llama-family) one")


def test_chat_without_template_and_prompt_errors(tmp_path, capsys, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path / "notemplate.gguf", smollm2_tokenizer_fields, chat_template=False)
    rc = cli.main(["generate", "--model", str(path), "--chat", "--prompt", "hi"])
    assert_one_line_error(rc, capsys.readouterr().err, "chat template")
    rc = cli.main(["generate", "--model", str(path), "--prompt-token-ids", "1,99999"])
    assert_one_line_error(rc, capsys.readouterr().err, "outside the vocabulary")
    rc = cli.main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "500"])
    assert_one_line_error(rc, capsys.readouterr().err, "exceed the context of 128 tokens")


# ---------------------------------------------------------------- tiny end to end


def test_generate_tiny_model_json_and_sampling(tmp_path, capsys, smollm2_tokenizer_fields,
                                               private_compile_cache):
    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    # Five runs, five engines: the later ones read the first one's programs from the cache.
    args = ["generate", "--model", str(path), "--chat", "--prompt", "Hello", "--max-tokens", "5",
            "--json", "--compile-cache-dir", str(private_compile_cache)]
    assert cli.main(args) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(greedy["token_ids"]) == 5 or greedy["finish_reason"] == "stop"
    assert isinstance(greedy["text"], str) and greedy["prompt_token_ids"][:1] == [1]
    assert cli.main(args) == 0  # greedy is deterministic
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == greedy
    hot = [json.loads((cli.main(args + ["--temperature", "5", "--seed", str(s)]),
                       capsys.readouterr().out)[1].strip().splitlines()[-1])["token_ids"]
           for s in range(3)]
    assert len({tuple(h) for h in hot}) > 1  # different seeds, different samples at T=5


def test_convert_to_orbax_round_trip(tmp_path, capsys):
    config = tiny()
    params = random_params(config)
    src = write_gguf(tmp_path / "m.gguf", config, params)
    dst = tmp_path / "ckpt"
    assert cli.main(["convert", str(src), str(dst)]) == 0
    out = capsys.readouterr()
    assert "loads in" in out.out and "from gguf" in out.out and "loaded gguf" in out.err
    meta = json.loads((dst / "jaxserve_model.json").read_text())
    assert meta["tokenizer_source"] == str(src.resolve())
    # The checkpoint holds the dequantized weights (no blocks, whatever the CPU kernels do).
    _, from_gguf = load_model(ModelSpec("m", "gguf", src), quantization="none")
    _, from_orbax = load_model(ModelSpec("m", "orbax", dst))
    assert_same_tree(from_orbax, jax.tree.map(np.asarray, from_gguf))
    rc = cli.main(["convert", str(src), str(dst)])
    assert_one_line_error(rc, capsys.readouterr().err, "already exists")


# ---------------------------------------------------------------- kernels


def test_kernels_build_then_status(tmp_path, capsys, monkeypatch):
    # Ahead of time, into a fresh kernel cache (an image's); status then finds it built.
    from jaxserve.kernels.cpu import library

    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("JAXSERVE_CPU_KERNELS", raising=False)
    assert cli.main(["kernels", "build"]) == 0
    built = library.plan().path
    assert built.exists() and str(built).startswith(str(tmp_path))
    assert f"built {built}" in capsys.readouterr().out
    assert cli.main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert f"library: {built} (built)" in out
    assert f"key {library.plan().key}" in out and "attention.cc" in out
    assert "switch: auto (JAXSERVE_CPU_KERNELS unset)" in out
    if jax.default_backend() == "cpu":
        assert "now: kernels: attention=cpu sampler=cpu" in out


def test_kernels_build_without_a_compiler_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    rc = cli.main(["kernels", "build"])
    assert_one_line_error(rc, capsys.readouterr().err, "no C++ compiler")


def test_kernels_status_honours_the_switch(capsys, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "off")
    assert cli.main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert "switch: off (JAXSERVE_CPU_KERNELS=off)" in out
    assert ("now: kernels: attention=xla sampler=xla matmul=xla; CPU kernels off: "
            "JAXSERVE_CPU_KERNELS=off") in out.splitlines() or jax.default_backend() != "cpu"


@pytest.mark.parametrize("argv", [["kernels", "status"],
                                  ["generate", "--model", "no-such-model", "--prompt", "hi"]])
def test_an_invalid_cpu_kernels_switch_fails_first(capsys, monkeypatch, argv):
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "fast")
    rc = cli.main(argv)
    assert_one_line_error(rc, capsys.readouterr().err,
                          "JAXSERVE_CPU_KERNELS='fast': expected one of auto, off")


@pytest.mark.parametrize("command", [
    ["serve", "--model", "m"], ["generate", "--model", "m", "--prompt", "hi"],
    ["batch", "--model", "m", "--input", "i.jsonl", "--output", "o.jsonl"]])
def test_every_engine_command_takes_cpu_kernels(capsys, command):
    parser = cli.build_parser()
    assert parser.parse_args([*command, "--cpu-kernels", "off"]).cpu_kernels == "off"
    assert parser.parse_args(command).cpu_kernels is None
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--cpu-kernels", "on"])
    assert "invalid choice: 'on'" in capsys.readouterr().err


def test_generate_with_cpu_kernels_off_logs_the_xla_paths(tmp_path, capsys, caplog, monkeypatch,
                                                          smollm2_tokenizer_fields):
    # The flag sets the process-wide switch (the environment variable) before the engine is
    # built, and the engine logs the paths it takes.
    import logging

    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "auto")  # restored (unset) after the test
    caplog.set_level(logging.INFO, logger="jaxserve.executor.runner")
    jax.clear_caches()
    path = tiny_gguf(tmp_path / "tiny.gguf", smollm2_tokenizer_fields)
    assert cli.main(["generate", "--model", str(path), "--prompt-token-ids", "1,2,3",
                     "--max-tokens", "2", "--cpu-kernels", "off"]) == 0
    assert os.environ["JAXSERVE_CPU_KERNELS"] == "off"
    assert ("kernels: attention=xla sampler=xla matmul=xla; CPU kernels off: "
            "JAXSERVE_CPU_KERNELS=off") in caplog.messages
    jax.clear_caches()

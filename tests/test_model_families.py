"""Each family (dense and mixture of experts) against HF transformers' own implementation,
without torch.

tests/fixtures/models/<family>/ holds a tiny random model saved by transformers (see
tools/make_model_fixtures.py, which also records HF's logits and greedy tokens). Here jaxserve
loads each directory as a user would and must give HF's logits within 1e-4 (f32, every position
of a prompt, through the serving step's own program) and HF's 32 greedy tokens for every prompt,
through one engine whose shape forces chunked prefill (8-token
steps), prefix caching (a prompt sharing 16 tokens with an earlier one) and preemption (a pool too
small for two sequences), and again with tensor parallelism over 2 virtual CPU devices (in a child
process: XLA fixes the device count at start). Also: config.json in both spellings and what is
refused, GGUF files as llama.cpp writes them, and `jaxserve convert` to orbax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.executor.batch_plan import SeqChunk, make_plan
from jaxserve.executor.models import decoder
from jaxserve.model_registry import ModelSpec

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir())
_CHILD = "JAXSERVE_FAMILIES_TP_CHILD"
needs_2 = pytest.mark.skipif(jax.device_count() < 2, reason="runs in the 2-device child process")
in_parent = pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="the parent runs it")


def expected(family: str) -> dict:
    return json.loads((FIXTURES / family / "expected.json").read_text())


def engine_args(**changes) -> dict:
    # 8-token steps chunk the 13-21 token prompts; 15 usable pages of 4 cannot hold two of the
    # 45-53 token sequences, so the second call preempts. 8 sequences: 8 logits rows per step,
    # so the logits check reads every position through the same program.
    args = dict(page_size=4, num_pages=16, max_num_batched_tokens=8, min_token_bucket=8,
                max_num_seqs=8, max_model_len=64, enable_prefix_caching=True, warmup=False,
                progress=False)
    return {**args, **changes}


def test_fixtures_cover_every_family_and_their_features_bind():
    from jaxserve.weights.architectures import ARCHITECTURES

    assert set(FAMILIES) == set(ARCHITECTURES)
    for family in FAMILIES:
        # Recorded by the fixture script: HF's logits with the family's feature switched off.
        for feature, diff in expected(family)["binding"].items():
            assert diff > 1e-2, (family, feature, diff)
        # Mixtures of experts: no routing decision on HF's run was near a tie of router logits,
        # so f32 rounding cannot pick another expert here.
        assert expected(family).get("min_route_gap", 1.0) > 1e-3, family


def _prompt_logits(engine, prompt: list[int]) -> np.ndarray:
    """Logits at every prompt position through the program serving runs (the engine's one
    8-token bucket, all 8 rows sampled), the prompt in chunks, in pages no request holds yet."""
    from jaxserve.shapes import cdiv

    runner, shapes = engine.runner, engine.runner.shapes
    pages = list(range(1, 1 + cdiv(len(prompt), shapes.page_size)))
    out = []
    for start in range(0, len(prompt), 8):
        chunk = prompt[start:start + 8]
        plan = make_plan([SeqChunk(chunk, start, pages)], num_tokens_padded=8,
                         num_seqs_padded=shapes.seq_bucket(8), pages_per_seq=shapes.pages_per_seq,
                         page_size=shapes.page_size, num_rows_padded=8)
        plan = plan._replace(logits_indices=np.arange(8, dtype=np.int32))
        out.append(np.asarray(runner.run_forward(plan))[:len(chunk)])
    return np.concatenate(out)


def _greedy(llm, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _check_engine(family: str, path: Path | None = None, weights: Path | None = None,
                  **changes):  # -> the LLM, for more
    """`path`: the fixture's directory (default: tests/fixtures/models/<family>); `weights`: what
    the engine loads, if not that directory (a GGUF file beside expected.json)."""
    from jaxserve.entrypoints.llm import LLM

    path = path or FIXTURES / family
    exp = json.loads((path / "expected.json").read_text())
    llm = LLM(str(weights or path), **engine_args(**changes))
    np.testing.assert_allclose(_prompt_logits(llm.engine, exp["prompts"][0]),
                               np.load(path / "logits.npy"), atol=1e-4, rtol=0)
    # The first prompt alone, then the others together: the second shares its first 16 tokens
    # (4 cached pages) and the two cannot fit the pool at once.
    got = _greedy(llm, exp["prompts"][:1]) + _greedy(llm, exp["prompts"][1:])
    assert got == exp["greedy"]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 16 and stats.num_preemptions > 0, stats
    return llm


@in_parent
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_match_hf_with_chunks_prefix_cache_and_preemption(family):
    _check_engine(family)


@in_parent
def test_tensor_parallel_in_2_device_subprocess():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", **{_CHILD: "1"})
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(Path(__file__).relative_to(root)), "-k", "tp2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(TP_FAMILIES)} passed" in proc.stdout, proc.stdout[-2000:]


# An engine each costs a compile, and the suite's time is short: Gemma 3 has what TP could break
# beyond the Llama shape (q/k norms, per-layer windows through lax.switch inside shard_map, local
# rope), Phi-3 its split fused projections and longrope, Qwen3-MoE the experts' grouped matmuls
# with their `mlp` axis sharded and a dense layer among them, gpt-oss its attention sinks split
# with the heads; the Llama shape is
# tests/test_sharding.py's.
TP_FAMILIES = ["gemma3_text", "phi3", "qwen3_moe", "gpt_oss"]


@needs_2
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_logits_and_greedy_tokens_match_hf(family):
    _check_engine(family, tensor_parallel_size=2)


# ---------------------------------------------------------------- config.json, both spellings

def _v4_spelling(cfg: dict) -> dict:
    """The same config as transformers 4.x wrote it: top-level rope keys, no layer_types."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types", None)
    if "full_attention" in rope:
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    rope = dict(rope)
    cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        cfg["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    if kind != "default":
        # (Phi-3's and DeepSeek-V3's released configs say "type".)
        cfg["rope_scaling"] = {"type" if cfg["model_type"] in ("phi3", "deepseek_v3")
                               else "rope_type": kind, **rope}
    return cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_same_in_both_spellings(family):
    from jaxserve.weights.architectures import config_from_hf

    cfg = json.loads((FIXTURES / family / "config.json").read_text())
    v5 = config_from_hf(cfg, family)
    assert v5 == config_from_hf(_v4_spelling(cfg), family)
    if family == "gemma3_text":
        assert v5.layer_windows == (8,) * 5 + (None,) and v5.local_rope_theta == 10000.0
    if family == "phi3":
        assert v5.rotary_dim == 12 and v5.rope_scaling.rope_type == "longrope"


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2' in config.json \\(supported: llama, "),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
     "unsupported rope scaling type 'dynamic' \\(supported: linear, llama3, longrope, yarn\\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "beta": 2}},
     "rope parameters jaxserve does not implement: beta"),
    ({"logn_attention": True}, "config.json keys jaxserve does not implement for qwen3: "
                               "logn_attention"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"attention_bias": True}, "attention_bias is not supported for qwen3"),
    ({"hidden_act": "relu"}, "unsupported activation 'relu'"),
])
def test_config_keys_it_does_not_understand_are_refused(tmp_path, change, message):
    import shutil

    from jaxserve.errors import WeightsError
    from jaxserve.weights import read_config

    path = tmp_path / "qwen3"
    shutil.copytree(FIXTURES / "qwen3", path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(WeightsError, match=message) as e:
        read_config(ModelSpec("qwen3", "hf", path))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- GGUF, as llama.cpp writes it

def write_gguf_like_llama_cpp(family: str, path: Path) -> Path:
    """The fixture as llama.cpp's converter writes it: gguf's own HF -> GGUF tensor names for
    the architecture, Gemma's norms stored as (1 + w), Phi-3's longrope factors as tensors."""
    import gguf
    from safetensors.numpy import load_file

    from jaxserve.weights.architectures import ARCHITECTURES, config_from_hf
    from tests.test_weights import _llama_cpp_permute, add_shape_metadata

    cfg = json.loads((FIXTURES / family / "config.json").read_text())
    c = config_from_hf(cfg, family)
    arch = ARCHITECTURES[family].gguf_name
    w = gguf.GGUFWriter(str(path), arch)
    add_shape_metadata(w, c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if c.attn_logit_softcap:
        w.add_attn_logit_softcapping(c.attn_logit_softcap)
        w.add_final_logit_softcapping(c.final_logit_softcap)
    rs = c.rope_scaling
    if rs is not None and rs.rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(c))
    if rs is not None and rs.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rs.factor)
    if rs is not None and rs.rope_type == "longrope":
        w.add_rope_dimension_count(c.rotary_dim)
        w.add_rope_scaling_attn_factors(rs.attention_factor)
        w.add_rope_scaling_orig_ctx_len(rs.original_max_position_embeddings)
        w.add_tensor("rope_factors_short.weight", np.asarray(rs.short_factor, np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(rs.long_factor, np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_layers)
    for name, t in load_file(str(FIXTURES / family / "model.safetensors")).items():
        if family.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _llama_cpp_permute(t, c.num_heads if "q_proj" in name else c.num_kv_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_rope_freqs(c) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for llama3 scaling (written from its description): per
    frequency, 1 below the high-frequency wavelength, `factor` past the low one, blended between."""
    import math

    rs = c.rope_scaling
    freqs = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float32) / c.head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < rs.original_max_position_embeddings / rs.high_freq_factor:
            out.append(1.0)
        elif wavelen > rs.original_max_position_embeddings / rs.low_freq_factor:
            out.append(rs.factor)
        else:
            smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
                      / (rs.high_freq_factor - rs.low_freq_factor))
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3_text", "phi3"])
def test_gguf_gives_the_hf_directory_s_model(tmp_path, family):
    from jaxserve.weights import load_host

    path = write_gguf_like_llama_cpp(family, tmp_path / f"{family}.gguf")
    got_config, got = load_host(ModelSpec(family, "gguf", path))
    want_config, want = load_host(ModelSpec(family, "hf", FIXTURES / family))
    # GGUF stores eps as float32; llama.cpp has no query_pre_attn_scalar (it uses head_dim, the
    # fixture's 24 shows the field is read from config.json).
    changes = dict(name=family, rms_norm_eps=got_config.rms_norm_eps)
    if family == "gemma2":
        changes["query_pre_attn_scalar"] = want_config.head_dim
    if family == "llama":  # llama3 scaling as rope_freqs: the same frequencies
        np.testing.assert_allclose(
            *(decoder.rope_frequencies(x.rope_theta, x.rope_scaling, x.head_dim)
              for x in (got_config, want_config)), rtol=1e-6)
        changes["rope_scaling"] = got_config.rope_scaling
    if family == "phi3":  # the longrope factors, float32 in GGUF too
        g, h = got_config.rope_scaling, want_config.rope_scaling
        for f in ("short_factor", "long_factor", "attention_factor"):
            np.testing.assert_allclose(getattr(g, f), getattr(h, f), rtol=1e-6)
        changes["rope_scaling"] = g
    assert got_config == want_config.replace(**changes)
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (p, a), (_, b) in zip(flat_got, flat_want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=str(p))


def test_manifest_covers_each_family(capsys):
    from jaxserve.entrypoints.cli import main

    for family in FAMILIES:
        assert main(["manifest", str(FIXTURES / family)]) == 0
        manifest = json.loads(capsys.readouterr().out)
        assert manifest["format"] == "hf" and manifest["id"].startswith("fp_")


def test_convert_to_orbax_keeps_each_family_s_config_and_weights(tmp_path, capsys):
    from jaxserve.entrypoints.cli import main
    from jaxserve.weights import load_host, load_model

    # Per-layer types and local rope; longrope factors; experts and a dense layer among them.
    for family in ("gemma3_text", "phi3", "qwen3_moe"):
        dst = tmp_path / family
        assert main(["convert", str(FIXTURES / family), str(dst)]) == 0
        config, params = load_model(ModelSpec(family, "orbax", dst))
        want_config, want = load_host(ModelSpec(family, "hf", FIXTURES / family))
        assert config == want_config
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, prefix):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: a text_config that transformers 4.x
    wrote sparse (defaults left out) and text tensors under a prefix (4.x / 5.x spelling)."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.weights import load_host

    text = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text())
    sparse = {k: v for k, v in text.items()
              if k not in ("hidden_activation", "rms_norm_eps", "model_type", "eos_token_id")}
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": sparse, "vision_config": {"model_type": "siglip_vision_model"},
           "mm_tokens_per_image": 256, "image_token_index": 262144, "eos_token_id": [2, 106]}
    path = tmp_path / "gemma-3-mm"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {prefix + k.removeprefix("model."): v
               for k, v in load_file(str(FIXTURES / "gemma3_text" / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    got_config, got = load_host(ModelSpec("mm", "hf", path))
    want_config, want = load_host(ModelSpec("mm", "hf", FIXTURES / "gemma3_text"))
    assert got_config == want_config.replace(name="gemma-3-mm", eos_token_ids=(2, 106))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)

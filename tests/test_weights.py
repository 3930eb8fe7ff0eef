"""Weight loaders: GGUF, HF safetensors and orbax all yield the same parameter tree; bad input fails
with one clear line naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.errors import JaxServeError, WeightsError
from jaxserve.model_registry import ModelSpec
from jaxserve.executor.models import decoder
from jaxserve.weights import load_model
from jaxserve.weights.checkpoint import load_checkpoint, save_checkpoint
from jaxserve.weights.gguf import load_gguf
from jaxserve.weights.safetensors import load_hf


def tiny(**changes) -> ModelConfig:
    # rms_norm_eps a power of two: GGUF stores it as float32, and the round trip must be exact.
    base = dict(name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=2.0 ** -20, rope_theta=10000.0,
                max_position_embeddings=128, bos_token_id=1, eos_token_ids=(2,))
    base.update(changes)
    return ModelConfig(**base)


LLAMA = tiny(architecture="llama")
QWEN2 = tiny(architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
MISTRAL = tiny(architecture="mistral", sliding_window=16, num_kv_heads=1)


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    return jax.tree.map(np.asarray, decoder.init_params(config, jax.random.key(seed)))


def to_hf(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The inverse of the loaders' mapping: our tree -> HF tensor names, torch [out, in] layout."""
    H = config.hidden_size
    out = {"model.embed_tokens.weight": params["embed_tokens"], "model.norm.weight": params["norm"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"].T
    lp = params["layers"]
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = lp["input_norm"][i]
        out[pre + "post_attention_layernorm.weight"] = lp["post_attention_norm"][i]
        for p in ("q", "k", "v"):
            out[pre + f"self_attn.{p}_proj.weight"] = lp[f"{p}_proj"][i].reshape(H, -1).T
            if config.attention_bias:
                out[pre + f"self_attn.{p}_proj.bias"] = lp[f"{p}_bias"][i].reshape(-1)
        out[pre + "self_attn.o_proj.weight"] = lp["o_proj"][i].reshape(-1, H).T
        for p in ("gate", "up", "down"):
            out[pre + f"mlp.{p}_proj.weight"] = lp[f"{p}_proj"][i].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_hf_dir(path: Path, config: ModelConfig, params: dict, *, shards: int = 2,
                 extra_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": config.architecture, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids), "sliding_window": config.sliding_window,
    }
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = to_hf(config, params)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (written from its description, not our code)."""
    out = w.shape[0]
    halves = w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def add_shape_metadata(w: GGUFWriter, config: ModelConfig) -> None:
    """The metadata every llama.cpp architecture has: the Llama shape's."""
    w.add_name(config.name)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])


def write_gguf(path: Path, config: ModelConfig, params: dict, *, arch: str | None = None,
               add_metadata=None, projections: dict | None = None) -> Path:
    """A GGUF as llama.cpp's converter writes it; `add_metadata(writer)` adds more keys;
    `projections`: {GGUF name (attn_q, ...): GGML type} for layer weights quantized to it."""
    arch = arch or ("qwen2" if config.architecture == "qwen2" else "llama")
    w = GGUFWriter(str(path), arch)
    if add_metadata is not None:
        add_metadata(w)
    add_shape_metadata(w, config)
    gguf_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in to_hf(config, params).items():
        if name == "model.embed_tokens.weight":
            # Quantized like the real file's embedding, to run the dequantize path.
            w.add_tensor("token_embd.weight", quants.quantize(t, GGMLQuantizationType.Q8_0),
                         raw_dtype=GGMLQuantizationType.Q8_0)
            continue
        if name in ("model.norm.weight", "lm_head.weight"):
            w.add_tensor({"model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], t)
            continue
        _, _, i, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_heads if module.endswith("q_proj") else config.num_kv_heads
            t = _llama_cpp_permute(t, heads)
        kind_type = (projections or {}).get(gguf_names[module]) if kind == "weight" else None
        if kind_type is not None:
            w.add_tensor(f"blk.{i}.{gguf_names[module]}.{kind}", quants.quantize(t, kind_type),
                         raw_dtype=kind_type)
            continue
        w.add_tensor(f"blk.{i}.{gguf_names[module]}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_tree(a: dict, b: dict, atol: float = 0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert x.shape == y.shape, path
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=atol,
                                   rtol=0, err_msg=str(path))


# ---------------------------------------------------------------- HF safetensors


@pytest.mark.parametrize("config", [LLAMA, QWEN2, MISTRAL], ids=lambda c: c.architecture)
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_round_trip(tmp_path, config, shards):
    params = random_params(config)
    path = write_hf_dir(tmp_path / "hf", config, params, shards=shards)
    loaded_config, loaded = load_hf(path)
    assert loaded_config == config.replace(name="hf")
    assert_same_tree(loaded, params)


def test_hf_bf16_weights_and_llama3_rope_scaling(tmp_path):
    import ml_dtypes

    params = random_params(LLAMA)
    bf16 = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    path = write_hf_dir(tmp_path / "hf", LLAMA, bf16, extra_config={"rope_scaling": scaling})
    config, loaded = load_hf(path)
    assert config.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=64)
    assert loaded["layers"]["q_proj"].dtype == np.float32
    assert_same_tree(loaded, bf16)


def test_hf_qwen2_ignores_disabled_sliding_window(tmp_path):
    path = write_hf_dir(tmp_path / "hf", QWEN2, random_params(QWEN2),
                        extra_config={"sliding_window": 32, "use_sliding_window": False})
    assert load_hf(path)[0].sliding_window is None


def test_hf_qwen2_window_slides_from_max_window_layers(tmp_path):
    # HF: with use_sliding_window, layers from max_window_layers on slide, the earlier ones not.
    path = write_hf_dir(tmp_path / "hf", QWEN2, random_params(QWEN2), extra_config={
        "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1})
    assert load_hf(path)[0].layer_windows == (None, 32)


def test_hf_bad_inputs(tmp_path):
    params = random_params(LLAMA)
    path = write_hf_dir(tmp_path / "gpt2", LLAMA, params, extra_config={"model_type": "gpt2"})
    with pytest.raises(WeightsError, match="unsupported model_type 'gpt2'"):
        load_hf(path)
    path = write_hf_dir(tmp_path / "missing", LLAMA, params, shards=1)
    tensors = to_hf(LLAMA, params)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf(path)
    path = write_hf_dir(tmp_path / "corrupt", LLAMA, params, shards=1)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightsError, match=str(path)):
        load_hf(path)
    path = write_hf_dir(tmp_path / "shape", LLAMA, params, shards=1,
                        extra_config={"num_attention_heads": 8, "num_key_value_heads": 8})
    with pytest.raises(WeightsError, match="shape does not match"):
        load_hf(path)


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=lambda c: c.architecture)
def test_gguf_round_trip_undoes_llama_cpp_permutation(tmp_path, config):
    params = random_params(config)
    path = write_gguf(tmp_path / "tiny.gguf", config, params)
    loaded_config, loaded = load_gguf(path)
    assert loaded_config == config.replace(name="tiny")
    # The embedding went through Q8_0: within its quantization step; the rest is exact.
    embed = quants.dequantize(quants.quantize(params["embed_tokens"], GGMLQuantizationType.Q8_0),
                              GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(loaded.pop("embed_tokens"), embed)
    params.pop("embed_tokens")
    assert_same_tree(loaded, params)


def test_gguf_blocks_kept_are_the_dequantized_load(tmp_path):
    # The seven projections of every layer in a supported type (a different one each), the
    # embedding Q8_0: kept as blocks (quantization "gguf"), llama.cpp's Q/K row order undone on
    # whole rows of blocks, they dequantize to exactly what the f32 load reads.
    from jaxserve.kernels.matmul import dequantize

    T = GGMLQuantizationType
    types = {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q4_1,
             "ffn_gate": T.Q4_0, "ffn_up": T.Q8_0, "ffn_down": T.Q4_1}
    path = write_gguf(tmp_path / "q.gguf", LLAMA, random_params(LLAMA), projections=types)
    config, f32 = load_gguf(path)
    config_q, kept = load_gguf(path, keep_blocks=True)
    assert config_q == config.replace(quantization="gguf", gguf_formats=(
        ("q_proj", "q4_0"), ("k_proj", "q4_1"), ("v_proj", "q8_0"), ("o_proj", "q4_1"),
        ("gate_proj", "q4_0"), ("up_proj", "q8_0"), ("down_proj", "q4_1"),
        ("embed_tokens", "q8_0")))
    formats = dict(config_q.gguf_formats)
    for name in decoder.PROJECTIONS:
        w = np.asarray(dequantize(kept["layers"][name], formats[name]))  # [L, N, K]
        np.testing.assert_array_equal(w.transpose(0, 2, 1).reshape(f32["layers"][name].shape),
                                      f32["layers"][name], err_msg=name)
    np.testing.assert_array_equal(np.asarray(dequantize(kept["embed_tokens"], "q8_0")),
                                  f32["embed_tokens"])
    assert jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), kept) == jax.tree.map(
        lambda x: (x.shape, np.dtype(x.dtype)), decoder.param_shapes(config_q))
    # One layer in another type: the projections are all dequantized (the embedding still kept).
    types["ffn_down"] = T.F16
    path = write_gguf(tmp_path / "mixed.gguf", LLAMA, random_params(LLAMA), projections=types)
    assert load_gguf(path, keep_blocks=True)[0].gguf_formats == (("embed_tokens", "q8_0"),)


def test_gguf_blocks_are_the_default_where_the_cpu_kernels_read_them(tmp_path, monkeypatch):
    # Unset, a GGUF file's blocks are kept on one CPU device in f32; a mesh, bf16, the kernels
    # switched off (or an accelerator: the same switch's question) and other formats load f32.
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.weights import resolve_quantization

    if not cpu_kernels.enabled():
        pytest.skip(f"the CPU kernels are off here: {cpu_kernels.why_off()}")
    T = GGMLQuantizationType
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                           "ffn_down"), T.Q4_0)
    spec = ModelSpec("q", "gguf", write_gguf(tmp_path / "q.gguf", LLAMA, random_params(LLAMA),
                                             projections=types))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    assert resolve_quantization(spec, None) == "gguf"
    assert load_model(spec)[0].quantization == "gguf"
    assert load_model(spec, quantization="none")[0].quantization is None
    assert resolve_quantization(spec, None, dtype="bfloat16") is None
    assert resolve_quantization(spec, None, mesh=mesh) is None
    assert resolve_quantization(ModelSpec("m", "hf", tmp_path), None) is None
    assert resolve_quantization(spec, "int8", mesh=mesh) == "int8"
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    assert resolve_quantization(spec, None) is None


def test_gguf_bad_inputs(tmp_path):
    params = random_params(LLAMA)
    bad_arch = write_gguf(tmp_path / "bert.gguf", LLAMA, params, arch="bert")
    with pytest.raises(WeightsError, match=r"bert\.gguf: unsupported GGUF architecture 'bert'"):
        load_gguf(bad_arch)
    good = write_gguf(tmp_path / "tiny.gguf", LLAMA, params).read_bytes()
    for name, data in [("truncated.gguf", good[:len(good) * 2 // 3]),
                       ("header.gguf", good[:100]),
                       ("garbage.gguf", b"not a gguf file at all" * 10)]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(WeightsError, match=str(tmp_path / name)) as e:
            load_gguf(tmp_path / name)
        assert "\n" not in str(e.value)
    with pytest.raises(WeightsError, match="no such GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


# ---------------------------------------------------------------- orbax and load_model


def test_orbax_round_trip_and_dtype_cast(tmp_path):
    params = random_params(QWEN2)
    save_checkpoint(tmp_path / "ckpt", QWEN2, params, tokenizer_source="/some/tokenizer.json")
    config, restored = load_checkpoint(tmp_path / "ckpt")
    assert config == QWEN2
    assert isinstance(restored["norm"], jax.Array)
    assert_same_tree(restored, params)
    config16, restored16 = load_checkpoint(tmp_path / "ckpt", dtype="bfloat16")
    assert config16.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(restored16))
    assert_same_tree(restored16, params, atol=0.02)
    with pytest.raises(WeightsError, match="already exists"):
        save_checkpoint(tmp_path / "ckpt", QWEN2, params, tokenizer_source=None)


def test_orbax_corrupted_checkpoint_is_one_clear_error(tmp_path):
    save_checkpoint(tmp_path / "ckpt", LLAMA, random_params(LLAMA), tokenizer_source=None)
    for f in (tmp_path / "ckpt" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 10)
    with pytest.raises(WeightsError, match=str(tmp_path / "ckpt")):
        load_checkpoint(tmp_path / "ckpt")


def test_load_model_every_format_gives_the_same_tree(tmp_path):
    params = random_params(LLAMA)
    hf = write_hf_dir(tmp_path / "hf", LLAMA, params)
    gg = write_gguf(tmp_path / "m.gguf", LLAMA, params)
    _, from_hf = load_model(ModelSpec("m", "hf", hf))
    save_checkpoint(tmp_path / "ckpt", LLAMA, jax.tree.map(np.asarray, from_hf), None)
    _, from_orbax = load_model(ModelSpec("m", "orbax", tmp_path / "ckpt"))
    _, from_gguf = load_model(ModelSpec("m", "gguf", gg), dtype="float32")
    assert_same_tree(from_orbax, from_hf)
    from_hf.pop("embed_tokens"), from_gguf.pop("embed_tokens")
    assert_same_tree(from_gguf, from_hf)
    assert isinstance(jax.tree.leaves(from_gguf)[0], jax.Array)
    config16, bf16 = load_model(ModelSpec("m", "hf", hf), dtype="bfloat16")
    assert config16.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16))
    assert issubclass(WeightsError, JaxServeError)


def test_load_model_int8_quantization_and_where_it_is_refused(tmp_path):
    from jaxserve.errors import ConfigError
    from jaxserve.core.engine_factory import build_engines

    config = tiny(intermediate_size=64)
    gg = write_gguf(tmp_path / "m.gguf", config, random_params(config))
    spec = ModelSpec("m", "gguf", gg)
    config8, params8 = load_model(spec, quantization="int8")
    assert config8.quantization == "int8"
    assert params8["layers"]["q_proj"].dtype == jnp.uint8
    assert params8["embed_tokens"].dtype == jnp.float32  # the LM head stays in the model's dtype
    assert config8.replace(quantization=None) == load_model(spec, quantization="none")[0]
    with pytest.raises(ConfigError, match="orbax"):
        load_model(ModelSpec("m", "orbax", tmp_path / "ckpt"), quantization="int8")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        load_model(spec, quantization="fp8")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        build_engines(str(gg), quantization="int8", tensor_parallel_size=2)

"""GGUF (llama.cpp) checkpoints: metadata -> ModelConfig, dequantized tensors -> parameter tree.

Tensors are dequantized with the `gguf` package (the same routine HF transformers uses, so golden
outputs computed from this file are reproducible bit for bit up to float32 arithmetic). With
`keep_blocks` (quantization "gguf"), the seven projections of every layer, when all are Q4_0,
Q4_1 or Q8_0 (one format per projection across the layers), and the embedding / LM head when it
is, stay the file's blocks as they are (`block_formats`): llama.cpp's [N rows, K / 32 blocks]
layout, which jaxserve.kernels.matmul reads in place and dequantizes to the same f32 values.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxserve.config import GGUF_TENSORS, ModelConfig
from jaxserve.errors import ConfigError, WeightsError
from jaxserve.weights import gguf_moe
from jaxserve.weights.architectures import architecture, config_from_hf, gguf_architectures
from jaxserve.weights.hf_layout import params_from_hf
from jaxserve.weights.moe_layout import EXPERT_NAMES

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Where llama.cpp's names mean another HF tensor: Gemma's ffn_norm is its pre-MLP norm (its
# post_attention_norm the attention output's); Phi-3's ffn_up is the fused gate_up_proj; gpt-oss's
# and deepseek2's own tensors: jaxserve.weights.gguf_moe.
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    **gguf_moe.LAYER_NAMES,
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Mixtures of experts: llama.cpp's converter stacks each layer's experts into one [E, out, in]
# tensor per projection; they are handed out by the HF name of each expert's (an [out, in] slice).
_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")
# GGML tensor types kept as blocks (quantization "gguf") -> jaxserve.kernels.matmul's formats.
_BLOCK_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
# The HF name of each tensor GGUF_TENSORS may keep: a layer's (with {i}) or a global one.
_KEPT_HF_NAMES = {
    "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
    "k_proj": "model.layers.{i}.self_attn.k_proj.weight",
    "v_proj": "model.layers.{i}.self_attn.v_proj.weight",
    "o_proj": "model.layers.{i}.self_attn.o_proj.weight",
    "gate_proj": "model.layers.{i}.mlp.gate_proj.weight",
    "up_proj": "model.layers.{i}.mlp.up_proj.weight",
    "down_proj": "model.layers.{i}.mlp.down_proj.weight",
    "embed_tokens": "model.embed_tokens.weight",
    "lm_head": "lm_head.weight",
}


def _hf_name(gguf_name: str, arch: str, model_type: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if model_type in EXPERT_NAMES:  # the router, and each stacked projection (see _EXPERTS)
        block, projections = EXPERT_NAMES[model_type]
        names["ffn_gate_inp"] = f"{block}.gate"
        names.update({k: f"{block}.experts.{projections[i]}" for k, i in _EXPERTS.items()})
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> HF's rotate-half halves).

    llama.cpp's converter regroups each head's rows (first half, second half) into interleaved
    pairs; reading them back as [head, pair, 2] and swapping the last two axes restores HF order.
    Works for weights [out, in] and biases [out].
    """
    rest = w.shape[1:]
    return (w.reshape(n_heads, -1, 2, *rest).swapaxes(1, 2).reshape(w.shape))


def _open(path: Path):
    from jaxserve.gguf_file import GGUFFile

    if not path.is_file():
        raise WeightsError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(str(path))
    except Exception as e:  # the reader fails in many ways on bad bytes; the user needs one line
        raise WeightsError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); the file is corrupted or "
            f"truncated — download it again") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _tensor(reader, name: str) -> np.ndarray | None:
    from gguf import quants

    for t in reader.tensors:
        if t.name == name:
            return quants.dequantize(t.data, t.tensor_type).reshape(-1)
    return None


def config_from_gguf(reader, path: Path, dtype: str = "float32") -> ModelConfig:
    """The metadata read as the config.json of the same model, then through the architectures'
    registry like any HF directory (jaxserve.weights.architectures)."""
    arch = _field(reader, "general.architecture")
    model_types = gguf_architectures()
    if arch not in model_types:
        raise WeightsError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: "
            f"{', '.join(model_types)})")
    experts = _field(reader, f"{arch}.expert_count")
    tensor_names = {t.name for t in reader.tensors}

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise WeightsError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    def meta(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise WeightsError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor a token list")
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    window = meta("attention.sliding_window")
    cfg = {
        # llama.cpp writes Mixtral as "llama" with experts.
        "model_type": "mixtral" if arch == "llama" and experts else model_types[arch],
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "sliding_window": int(window) if window else None,
    }
    if arch in gguf_moe.LAYER_NAMES:  # gpt-oss, deepseek2
        cfg.update(gguf_moe.config(arch, meta, need, str(path)))
    elif experts:
        # llama.cpp's qwen3moe and llama (Mixtral) renormalize the top-k weights unless the file
        # says otherwise; every qwen3moe layer is sparse (it has no mlp_only_layers).
        cfg["num_experts_per_tok"] = int(need("expert_used_count"))
        if arch == "llama":  # (Mixtral renormalizes always)
            cfg["num_local_experts"] = int(experts)
        else:
            cfg.update(num_experts=int(experts), norm_topk_prob=bool(meta("expert_weights_norm",
                                                                         True)),
                       moe_intermediate_size=int(need("expert_feed_forward_length")))
    if arch in ("gemma2", "gemma3"):
        # llama.cpp does not store query_pre_attn_scalar: it uses head_dim, but hidden / heads
        # for the 27B models (the only ones where they differ), and so does this.
        scalar = hidden // heads if hidden in (4608, 5376) else head_dim
        cfg.update(query_pre_attn_scalar=scalar,
                   attn_logit_softcapping=meta("attn_logit_softcapping"),
                   final_logit_softcapping=meta("final_logit_softcapping"))
    if arch == "gemma3":
        # llama.cpp's fixed base for the sliding layers; the global ones may be linearly scaled.
        cfg["rope_local_base_freq"] = 10000.0
        if meta("rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(meta("rope.scaling.factor"))}
    rope_freqs = _tensor(reader, "rope_freqs.weight")
    if rope_freqs is not None:
        # Llama 3.1+: llama.cpp bakes the llama3 scaling into per-frequency divisors, as it
        # stores Phi-3's longrope factors; the same factors for every position are longrope's
        # math with one set of factors and no attention factor.
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": rope_freqs.tolist(),
                               "long_factor": rope_freqs.tolist(), "attention_factor": 1.0,
                               "original_max_position_embeddings": cfg["max_position_embeddings"]}
    if arch == "phi3":
        rotary = meta("rope.dimension_count")
        if rotary is not None:
            cfg["partial_rotary_factor"] = int(rotary) / head_dim
        short, long = (_tensor(reader, f"rope_factors_{k}.weight") for k in ("short", "long"))
        if short is not None:
            cfg["original_max_position_embeddings"] = int(
                meta("rope.scaling.original_context_length"))
            cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": short.tolist(),
                                   "long_factor": long.tolist(),
                                   "attention_factor": meta("rope.scaling.attn_factor")}
    try:
        return config_from_hf(cfg, str(_field(reader, "general.name", path.stem)), dtype)
    except ConfigError as e:
        raise WeightsError(f"{path}: {e}") from None


def read_gguf_config(path: Path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig alone (the tensors are memory-mapped, not read)."""
    return config_from_gguf(_open(Path(path)), Path(path), dtype)


def block_formats(config: ModelConfig, by_hf_name: dict) -> dict[str, str]:
    """The tensors (GGUF_TENSORS) a float32 dense model keeps as blocks, and their formats: the
    seven projections if every layer's are of one supported type each (else none of them), and
    embed_tokens / lm_head if theirs is supported. Empty for what the loader re-lays out (fused
    projections, experts, latent attention)."""
    c = config
    if (c.dtype != "float32" or c.num_experts or c.mla is not None
            or architecture(c.architecture).fused_projections):
        return {}
    formats = {}
    for name in GGUF_TENSORS[:7]:
        types = {getattr(by_hf_name.get(_KEPT_HF_NAMES[name].format(i=i)), "tensor_type", None)
                 for i in range(c.num_layers)}
        kind = types.pop().name if len(types) == 1 and None not in types else None
        if kind not in _BLOCK_TYPES:
            formats = {}
            break
        formats[name] = _BLOCK_TYPES[kind]
    for name in GGUF_TENSORS[7:]:
        t = by_hf_name.get(_KEPT_HF_NAMES[name])
        if t is not None and t.tensor_type.name in _BLOCK_TYPES:
            formats[name] = _BLOCK_TYPES[t.tensor_type.name]
    return formats


def load_gguf(path: Path, dtype: str = "float32",
              keep_blocks: bool = False) -> tuple[ModelConfig, dict]:
    """Read a GGUF file: (ModelConfig, parameter tree of host numpy arrays in `dtype`).
    keep_blocks: the tensors of `block_formats` stay blocks (config.quantization "gguf")."""
    from gguf import quants

    from jaxserve.kernels.matmul import row_bytes

    path = Path(path)
    reader = _open(path)
    config = config_from_gguf(reader, path, dtype)
    arch = _field(reader, "general.architecture")
    by_hf_name = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch, config.architecture)
        if name is not None:
            by_hf_name[name] = t
    permute_heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    formats = block_formats(config, by_hf_name) if keep_blocks else {}
    if formats:
        config = config.replace(quantization="gguf", gguf_formats=tuple(
            (name, formats[name]) for name in GGUF_TENSORS if name in formats))
    stacked: dict[str, np.ndarray] = {}  # the experts' tensor being read (one at a time)

    def dequantize(t) -> np.ndarray:
        try:
            return quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise WeightsError(f"{path}: tensor {t.name} cannot be dequantized ({e})") from None

    def get(name: str) -> np.ndarray:
        rebuilt = gguf_moe.tensor(arch, name, lambda n: dequantize(by_hf_name[n]),
                                  by_hf_name.__contains__)
        if rebuilt is not None:
            return rebuilt
        expert = _EXPERT_RE.match(name)
        if expert is not None:  # one expert of a stacked [E, out, in] tensor
            key = f"{expert.group(1)}.{expert.group(3)}.weight"
            if key not in stacked:
                stacked.clear()
                stacked[key] = dequantize(by_hf_name[key])
            return stacked[key][int(expert.group(2))]
        t = by_hf_name[name]
        w = dequantize(t)
        proj = name.split(".")[-2]
        if arch == "llama" and proj in permute_heads:
            w = _unpermute_rope(w, permute_heads[proj])
        if config.norm_offset and name.endswith("norm.weight"):
            w = w - config.norm_offset  # llama.cpp's Gemma converter stores (1 + w)
        return w

    def blocks(name: str, hf_name: str, rows: int, k: int) -> np.ndarray:
        """One tensor's blocks [rows, k / 32 * bytes], llama.cpp's rope rows undone."""
        t = by_hf_name[hf_name]
        data = np.asarray(t.data, np.uint8)
        if data.shape != (rows, row_bytes(formats[name], k)):
            raise WeightsError(f"{path}: tensor {t.name} holds {data.shape} bytes of blocks, "
                               f"expected {(rows, row_bytes(formats[name], k))}")
        if arch == "llama" and name in permute_heads:
            data = _unpermute_rope(data, permute_heads[name])
        return data

    params = params_from_hf(config, get, str(path), frozenset(formats))
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
              "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q),
              "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}  # (N, K) of each projection
    for name, (rows, k) in shapes.items():
        if name in formats:
            params["layers"][name] = np.stack([
                blocks(name, _KEPT_HF_NAMES[name].format(i=i), rows, k)
                for i in range(c.num_layers)])
    for name in GGUF_TENSORS[7:]:
        if name in formats:
            params[name] = blocks(name, _KEPT_HF_NAMES[name], c.vocab_size, c.hidden_size)
    return config, params

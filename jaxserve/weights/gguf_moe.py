"""llama.cpp's `gpt-oss` and `deepseek2` GGUF files (gpt-oss; DeepSeek-V3 / R1, Kimi K2): their
metadata read as the config.json of the same HF model, and the tensors llama.cpp's converter
(convert_hf_to_gguf.py) lays out otherwise than HF handed back under HF's names, so that
jaxserve.weights.hf_layout builds them like any checkpoint.

What the converter changes, and what is undone here:
- gpt-oss: HF's interleaved `gate_up_proj` [E, in, 2 * out] is split into `ffn_gate_exps` and
  `ffn_up_exps` [E, out, in] (or, with --fuse-gate-up-exps, `ffn_gate_up_exps`, gate rows then
  up rows), `down_proj` [E, in, out] transposed to `ffn_down_exps`, the sinks `attn_sinks`. MXFP4
  experts (GGML type 39, as ggml-org's gpt-oss GGUFs store them) dequantize with the gguf
  package like any block type. llama.cpp fixes the experts' SwiGLU clamp at 7.0 and alpha at
  1.702 (gpt-oss's), and the file stores no YaRN `truncate`: gpt-oss's own (false) is used.
- deepseek2: MLA is written as MQA over the latent (head_count_kv 1, key_length = kv_lora_rank +
  rope dims; the real head sizes in key_length_mla / value_length_mla, or in key_length /
  value_length in files from before that change); `kv_b_proj` is split into `attn_k_b`
  (transposed) and `attn_v_b` in newer files; the correction bias is `exp_probs_b`. llama.cpp
  rotates interleaved pairs (HF's rope_interleave) and, with YaRN, scales no cos / sin but
  multiplies the attention scale by (1 + 0.1 mscale_all_dim ln factor)^2, where the file's
  yarn_log_multiplier is 0.1 mscale_all_dim: HF's math with mscale equal to mscale_all_dim.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.errors import WeightsError

# llama.cpp's names for the tensors of these architectures (beyond the Llama shape's) -> the HF
# module they stand for in jaxserve.weights.gguf's naming (`.weight` / `.bias` appended). Some are
# not HF's names (the split experts, k_b / v_b): `tensor` rebuilds HF's tensor from them.
LAYER_NAMES = {
    "gpt-oss": {"attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
                "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
                "ffn_down_exps": "mlp.experts.down_proj"},
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj",
                  "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                  "exp_probs_b": "mlp.gate.e_score_correction",
                  "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"},
}
# YaRN factors llama.cpp can be told to change, and their values that leave the model's own
# YaRN (yarn_ext_factor -1: llama.cpp's "unset", 1.0 under YaRN).
_YARN_AS_DEFINED = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,),
                    "yarn_ext_factor": (1.0, -1.0)}
_SIGMOID = 2  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid
# llama.cpp's gpt-oss graph: ggml_swiglu_oai(alpha 1.702, limit 7.0), not in the file.
_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def config(arch: str, meta: Callable, need: Callable, where: str) -> dict:
    """The config.json keys of `arch` beyond the Llama shape's (jaxserve.weights.gguf reads
    those), from its metadata: meta(key, default) / need(key) read `{arch}.key`."""
    if arch == "gpt-oss":
        layers = int(need("block_count"))
        return {
            "num_local_experts": int(need("expert_count")),
            "num_experts_per_tok": int(need("expert_used_count")),
            "intermediate_size": int(meta("expert_feed_forward_length")
                                     or need("feed_forward_length")),
            # llama.cpp's swa pattern 2: the even layers slide (HF's default layer_types too).
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(layers)],
            "attention_bias": True, **_GPT_OSS_SWIGLU,
            "rope_parameters": _rope(meta, where, truncate=False),
        }
    gating = meta("expert_gating_func")
    if gating != _SIGMOID:
        # (llama.cpp reads a file without it as softmax: DeepSeek-V2 / V2.5.)
        raise WeightsError(f"{where}: deepseek2 expert_gating_func {gating!r} is not supported "
                           f"(only sigmoid, {_SIGMOID}: DeepSeek-V3 and the models built on it)")
    rope_dims = int(need("rope.dimension_count"))
    if meta("attention.key_length_mla") is not None:
        qk_head, v_head = need("attention.key_length_mla"), need("attention.value_length_mla")
    else:
        qk_head, v_head = need("attention.key_length"), need("attention.value_length")
    rope = _rope(meta, where)
    if rope.get("rope_type") == "yarn":
        rope["attention_factor"] = 1.0  # cos / sin unscaled (see the module's docstring)
        log_mul = meta("rope.scaling.yarn_log_multiplier")
        if log_mul:
            rope["mscale"] = rope["mscale_all_dim"] = float(log_mul) / 0.1
    heads = int(need("attention.head_count"))
    return {
        # Multi-token prediction layers (after the model's) are not run.
        "num_hidden_layers": int(need("block_count")) - int(meta("nextn_predict_layers", 0)),
        "num_key_value_heads": heads, "head_dim": rope_dims,
        "q_lora_rank": meta("attention.q_lora_rank"),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_nope_head_dim": int(qk_head) - rope_dims, "qk_rope_head_dim": rope_dims,
        "v_head_dim": int(v_head),
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(meta("expert_shared_count", 0)),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "first_k_dense_replace": int(meta("leading_dense_block_count", 0)),
        "n_group": int(meta("expert_group_count", 1)),
        "topk_group": int(meta("expert_group_used_count", 1)),
        "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
        # llama.cpp's rule: no renormalization unless the file says so.
        "norm_topk_prob": bool(meta("expert_weights_norm", False)),
        "scoring_func": "sigmoid", "rope_interleave": True, "sliding_window": None,
        "rope_parameters": rope,
    }


def _rope(meta: Callable, where: str, **extra) -> dict:
    """rope_parameters from `rope.*`: default or YaRN (what these architectures use)."""
    theta = float(meta("rope.freq_base", 10000.0))
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise WeightsError(f"{where}: rope.scaling.type {kind!r} is not supported here (only "
                           f"yarn or none)")
    for key, served in _YARN_AS_DEFINED.items():
        value = meta(f"rope.scaling.{key}")
        if value is not None and float(value) not in served:
            raise WeightsError(f"{where}: rope.scaling.{key}={value} is not supported (YaRN as "
                               f"the model defines it only)")
    return {"rope_type": "yarn", "rope_theta": theta,
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)), **extra}


def tensor(arch: str, name: str, read: Callable[[str], np.ndarray],
           has: Callable[[str], bool]) -> np.ndarray | None:
    """HF's tensor `name` rebuilt from the file's (read / has: by jaxserve.weights.gguf's names),
    or None where the file holds it as it is."""
    if arch == "gpt-oss":
        if name.endswith(".self_attn.sinks"):
            return read(name + ".weight")
        experts = name.rsplit(".", 1)[0] + "."
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.gate_up_proj_bias"):
            kind = "bias" if name.endswith("_bias") else "weight"
            if has(f"{experts}gate_up_proj.{kind}"):  # fused: gate rows, then up rows
                gate, up = np.split(read(f"{experts}gate_up_proj.{kind}"), 2, axis=1)
            else:
                gate, up = (read(f"{experts}{p}_proj.{kind}") for p in ("gate", "up"))
            if kind == "weight":  # [E, out, in] -> HF's [E, in, out]
                gate, up = gate.swapaxes(-1, -2), up.swapaxes(-1, -2)
            fused = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
            fused[..., 0::2], fused[..., 1::2] = gate, up  # HF's interleaved columns
            return fused
        if name.endswith("experts.down_proj"):
            return read(name + ".weight").swapaxes(-1, -2)
        if name.endswith("experts.down_proj_bias"):
            return read(experts + "down_proj.bias")
    if arch == "deepseek2":
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            return read(name.replace("_bias", ".bias"))
        if name.endswith("self_attn.kv_b_proj.weight") and not has(name):
            # k_b [H, kv_lora_rank, nope] and v_b [H, v_head_dim, kv_lora_rank] -> HF's
            # [H * (nope + v_head_dim), kv_lora_rank].
            k_b = read(name.replace("kv_b_proj", "k_b_proj"))
            v_b = read(name.replace("kv_b_proj", "v_b_proj"))
            return np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, k_b.shape[1])
    return None

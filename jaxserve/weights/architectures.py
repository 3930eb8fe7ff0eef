"""The registry of architectures: HF `model_type` -> how its config.json maps to ModelConfig.

Every family runs the one decoder (jaxserve.executor.models.decoder); an entry here says which of
its ModelConfig fields the family sets and which config.json keys it reads. Every key that changes
the math is read in both spellings transformers has written (4.x: top-level `rope_theta`,
`rope_scaling`, `rope_local_base_freq`, `partial_rotary_factor`; 5.x: `rope_parameters`, flat or per
layer type), and a key no entry understands is refused (`_check_keys`) rather than ignored: a
checkpoint that needs math jaxserve lacks fails to load instead of loading wrong. A new family
(the mixture-of-experts ones of issue 36 too) is one more `Architecture` in ARCHITECTURES.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.errors import ConfigError
from jaxserve.weights import fp8, mxfp4

# Keys that describe the checkpoint or training, never the forward pass.
_METADATA_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "pad_token_id", "attention_dropout", "embd_pdrop", "resid_pdrop",
    "_name_or_path", "auto_map", "cache_implementation", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "torchscript", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "task_specific_params", "problem_type",
    "finetuning_task", "tie_encoder_decoder", "add_cross_attention", "tf_legacy_loss",
    "use_bfloat16", "is_decoder", "bad_words_ids", "decoder_start_token_id", "sep_token_id",
    "prefix", "cross_attention_hidden_size", "max_length", "min_length", "num_beams",
    "temperature", "top_k", "top_p", "do_sample", "repetition_penalty", "length_penalty",
    # Llama's tensor-parallel training split: HF's inference ignores it (the same matmul).
    "pretraining_tp",
    "is_llama_config",  # SmolLM2's configs (nanotron): a marker
    # Read only with a window (Qwen2/3: which layers slide), through layer_types.
    "max_window_layers", "use_sliding_window", "sliding_window_pattern", "_sliding_window_pattern",
})
# Keys read by every family (the Llama shape).
_COMMON_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "hidden_act", "attention_bias", "sliding_window", "layer_types",
    "partial_rotary_factor",
    "quantization_config",  # checked by config_from_hf (jaxserve.weights.fp8)
})
# Keys whose only value jaxserve serves (anything else changes the math).
_REQUIRED = {"mlp_bias": False, "lm_head_bias": False, "use_bidirectional_attention": False,
             "full_attn_mod": 1, "interpolate_factor": 1,
             "rope_interleaved": False}  # SmolLM2's: False is HF's rotate-half
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                        "high_freq_factor", "original_max_position_embeddings", "short_factor",
                        "long_factor", "attention_factor", "partial_rotary_factor",
                        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})


@dataclass(frozen=True)
class Architecture:
    """One family: its HF model_type, llama.cpp's name for it, and what it sets."""

    model_type: str
    gguf_name: str | None
    # ModelConfig fields of this family from config.json (beyond the Llama shape's).
    fields: Callable[[dict], dict] = lambda cfg: {}
    keys: frozenset[str] = frozenset()  # config.json keys `fields` reads
    default_rope_theta: float = 10000.0
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint
    attention_bias: bool = False  # Qwen2: q/k/v biases always
    label: str = ""  # the families it covers, for messages and docs


def _sliding_layers(cfg: dict, default: Callable[[int], bool]) -> dict:
    """sliding_window and layer_types as HF builds them when the config has no layer_types."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if default(i) else "full_attention" for i in range(layers)]
    window = cfg.get("sliding_window")
    if window is None or "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": ()}
    # Every layer sliding (Mistral) is ModelConfig's default for a window: one canonical config.
    return {"sliding_window": window,
            "layer_types": () if "full_attention" not in types else tuple(types)}


def _qwen(cfg: dict) -> dict:
    # The window is off unless use_sliding_window; then layers from max_window_layers slide.
    if not cfg.get("use_sliding_window", False):
        return {"sliding_window": None, "layer_types": ()}
    first = cfg.get("max_window_layers", 28)
    return _sliding_layers(cfg, lambda i: i >= first)


def _gemma(pattern: Callable[[dict], int], qk_norm: bool) -> Callable[[dict], dict]:
    def fields(cfg: dict) -> dict:
        every = pattern(cfg)
        return {
            **_sliding_layers(cfg, lambda i: bool((i + 1) % every)),
            "norm_offset": 1.0, "sandwich_norms": True, "qk_norm": qk_norm,
            "embedding_multiplier": cfg["hidden_size"] ** 0.5,
            "hidden_act": _activation(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
            "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"),
            "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
        }
    return fields


def _moe(cfg: dict, expert_size: str, sparse: Callable[[int], bool],
         norm_topk_prob: bool) -> dict:
    """Mixture-of-experts fields; a model whose every layer is dense is served as dense."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if not sparse(i))
    if not experts or len(dense) == cfg["num_hidden_layers"]:
        return {}
    return {"num_experts": experts, "experts_per_token": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg[expert_size], "norm_topk_prob": norm_topk_prob,
            "dense_layers": dense}


def _qwen3_moe(cfg: dict) -> dict:
    # HF's rule: sparse unless listed in mlp_only_layers, on every decoder_sparse_step-th layer.
    only_dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1)
    return {**_qwen(cfg), "qk_norm": True,
            **_moe(cfg, "moe_intermediate_size",
                   lambda i: i not in only_dense and (i + 1) % step == 0,
                   cfg.get("norm_topk_prob", False))}


def _deepseek_v3(cfg: dict) -> dict:
    from jaxserve.config import MlaConfig

    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                       ("moe_layer_freq", 1)):
        if cfg.get(key) not in (None, value):
            raise ConfigError(f"config.json {key}={cfg[key]!r} is not supported (only {value!r})")
    rope, _ = _rope_dicts(cfg, ARCHITECTURES["deepseek_v3"])
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    if _rope_type(rope) != "default" and rope.get("mscale_all_dim"):
        # HF's DeepseekV3Attention: YaRN's mscale (of mscale_all_dim), squared, on the scores.
        scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    mla = MlaConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    softmax_scale=scale, rope_interleave=bool(cfg.get("rope_interleave", True)))
    first_dense = cfg.get("first_k_dense_replace") or 0
    return {"mla": mla,
            **_moe({**cfg, "num_experts": cfg["n_routed_experts"]}, "moe_intermediate_size",
                   lambda i: i >= first_dense, bool(cfg.get("norm_topk_prob", True))),
            "moe_scoring": "sigmoid", "moe_num_groups": cfg.get("n_group") or 1,
            "moe_topk_groups": cfg.get("topk_group") or 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "num_shared_experts": cfg.get("n_shared_experts") or 0}


_DEEPSEEK_KEYS = frozenset({
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "n_routed_experts", "n_shared_experts", "n_group", "topk_group",
    "routed_scaling_factor", "first_k_dense_replace", "moe_intermediate_size", "norm_topk_prob",
    "rope_interleave", "scoring_func", "topk_method", "moe_layer_freq",
    # Training (the auxiliary loss, its expert-parallel size) and the multi-token prediction
    # layers, which plain decoding does not run (their tensors are not read).
    "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers", "num_mtp_layers"})

def _gpt_oss(cfg: dict) -> dict:
    # The released configs also carry `experts_per_token` (the same top-k) and
    # `initial_context_length` (YaRN's original context, which rope_scaling repeats).
    if cfg.get("experts_per_token") not in (None, cfg["num_experts_per_tok"]):
        raise ConfigError(f"config.json experts_per_token={cfg['experts_per_token']!r} differs "
                          f"from num_experts_per_tok={cfg['num_experts_per_tok']!r}")
    if cfg.get("attention_bias") is False:
        raise ConfigError("config.json attention_bias=False is not supported for gpt_oss")
    return {**_sliding_layers(cfg, lambda i: i % 2 == 0),
            **_moe(cfg, "intermediate_size", lambda i: True, True),
            "moe_bias": True, "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "o_proj_bias": True,
            "attention_sinks": True}


# Training-only keys of the MoE families (the auxiliary loss, jitter): inference ignores them.
_MOE_KEYS = frozenset({"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits",
                       "router_jitter_noise", "num_local_experts"})

_GEMMA_KEYS = frozenset({"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping"})

ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", "llama", label="Llama 2 / 3 / 3.1-3.3, SmolLM2"),
    # llama.cpp writes Mistral as "llama" (a window in its metadata).
    Architecture("mistral", None, fields=lambda cfg: _sliding_layers(cfg, lambda i: True),
                 label="Mistral"),
    Architecture("qwen2", "qwen2", fields=_qwen, attention_bias=True, label="Qwen2 / Qwen2.5"),
    Architecture("qwen3", "qwen3", fields=lambda cfg: {**_qwen(cfg), "qk_norm": True},
                 label="Qwen3"),
    Architecture("gemma2", "gemma2", fields=_gemma(lambda cfg: 2, qk_norm=False),
                 keys=_GEMMA_KEYS, label="Gemma 2"),
    Architecture("gemma3_text", "gemma3",
                 fields=_gemma(lambda cfg: (cfg.get("sliding_window_pattern")
                                      or cfg.get("_sliding_window_pattern") or 6), qk_norm=True),
                 keys=_GEMMA_KEYS | {"rope_local_base_freq"}, default_rope_theta=1_000_000.0,
                 label="Gemma 3 (text)"),
    Architecture("phi3", "phi3", fields=lambda cfg: _sliding_layers(cfg, lambda i: True),
                 keys=frozenset({"original_max_position_embeddings"}), fused_projections=True,
                 label="Phi-3 / 3.5 / 4-mini"),
    # Mixture of experts (jaxserve.executor.models.moe). llama.cpp writes Mixtral as "llama"
    # with an expert count (jaxserve.weights.gguf); its experts stacked per layer.
    Architecture("mixtral", None,
                 fields=lambda cfg: _moe(cfg, "intermediate_size", lambda i: True, True),
                 keys=_MOE_KEYS, label="Mixtral"),
    Architecture("qwen3_moe", "qwen3moe", fields=_qwen3_moe,
                 keys=_MOE_KEYS | {"num_experts", "moe_intermediate_size", "norm_topk_prob",
                                   "mlp_only_layers", "decoder_sparse_step"},
                 label="Qwen3-MoE"),
    # Router and expert biases, clamped SwiGLU experts, attention sinks, o_proj bias; the MLPs
    # of jaxserve.executor.models.moe, MXFP4 experts dequantized by jaxserve.weights.mxfp4.
    Architecture("gpt_oss", "gpt-oss", fields=_gpt_oss, attention_bias=True,
                 default_rope_theta=150000.0,
                 keys=_MOE_KEYS | {"swiglu_limit", "swiglu_alpha", "experts_per_token",
                                   "initial_context_length"},
                 label="gpt-oss"),
    # Multi-head latent attention (jaxserve.executor.models.mla) and DeepSeek's routing.
    Architecture("deepseek_v3", "deepseek2", fields=_deepseek_v3, keys=_MOE_KEYS | _DEEPSEEK_KEYS,
                 label="DeepSeek-V3 / R1"),
)}


@dataclass(frozen=True)
class TextOf:
    """A multimodal checkpoint served as its text model (images are not served): where its text
    config and tensors are."""

    text_model_type: str
    # The text config class's defaults: transformers 4.x wrote only the values that differ.
    text_defaults: dict
    # Prefixes that stand for the text model's "model." / "lm_head." in tensor names (4.x, 5.x).
    tensor_prefixes: dict[str, str]
    keys: frozenset[str]  # the wrapper's own keys: the vision side, not the text model's math


MULTIMODAL = {
    "gemma3": TextOf(
        "gemma3_text",
        text_defaults=dict(
            vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
            hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
            rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, bos_token_id=2,
            eos_token_id=1),
        tensor_prefixes={"language_model.model.": "model.", "model.language_model.": "model.",
                         "language_model.lm_head.": "lm_head."},
        keys=frozenset({"text_config", "vision_config", "mm_tokens_per_image", "boi_token_index",
                        "eoi_token_index", "image_token_index", "image_token_id",
                        "boi_token_id", "eoi_token_id"})),
}


def supported() -> str:
    return ", ".join([*ARCHITECTURES, *MULTIMODAL])


def text_config(cfg: dict) -> dict:
    """config.json of a MULTIMODAL checkpoint -> that of its text model (others unchanged)."""
    wrapper = MULTIMODAL.get(cfg.get("model_type"))
    if wrapper is None:
        return cfg
    unknown = sorted(k for k, v in cfg.items()
                     if k not in wrapper.keys | _METADATA_KEYS | _COMMON_KEYS and v is not None)
    if unknown:
        raise ConfigError(f"config.json keys jaxserve does not implement for "
                          f"{cfg['model_type']}: {', '.join(unknown)}")
    inherited = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
                 if cfg.get(k) is not None}
    return {**wrapper.text_defaults, **inherited, **(cfg.get("text_config") or {}),
            "model_type": wrapper.text_model_type}


def text_tensor_name(name: str, model_type: str) -> str:
    """A MULTIMODAL checkpoint's tensor name as its text model's (others unchanged)."""
    wrapper = MULTIMODAL.get(model_type)
    for prefix, text in (wrapper.tensor_prefixes.items() if wrapper else ()):
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def gguf_architectures() -> dict[str, str]:
    """llama.cpp's architecture name -> the HF model_type its GGUF files load as."""
    return {a.gguf_name: a.model_type for a in ARCHITECTURES.values() if a.gguf_name}


def architecture(model_type) -> Architecture:
    if model_type not in ARCHITECTURES:  # (MULTIMODAL ones arrive as their text model)
        raise ConfigError(f"unsupported model_type {model_type!r} in config.json (supported: "
                          f"{supported()})")
    return ARCHITECTURES[model_type]


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ConfigError(f"unsupported activation {name!r} (supported: "
                          f"{', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _check_keys(cfg: dict, arch: Architecture) -> None:
    known = _METADATA_KEYS | _COMMON_KEYS | arch.keys | set(_REQUIRED)
    # A key set to null asks for nothing; one with a value jaxserve does not read may change the
    # model's output, so the checkpoint is refused rather than served wrong.
    unknown = sorted(k for k, v in cfg.items() if k not in known and v is not None)
    if unknown:
        raise ConfigError(f"config.json keys jaxserve does not implement for {arch.model_type}: "
                          f"{', '.join(unknown)}")
    for key, value in _REQUIRED.items():
        if key not in arch.keys and cfg.get(key) not in (None, value):
            raise ConfigError(f"config.json {key}={cfg[key]!r} is not supported (only {value!r})")


def _rope_dicts(cfg: dict, arch: Architecture) -> tuple[dict, dict | None]:
    """(the rope of full-attention layers, that of sliding layers or None), each one flat dict in
    rope_parameters' spelling, with the 4.x top-level keys filled in where 5.x puts them inside."""
    params = cfg.get("rope_parameters")
    if params is None:
        main = dict(cfg.get("rope_scaling") or {})
        local = ({"rope_theta": cfg["rope_local_base_freq"]}
                 if cfg.get("rope_local_base_freq") is not None else None)
    elif set(params) <= {"full_attention", "sliding_attention"}:
        main, local = dict(params.get("full_attention") or {}), params.get("sliding_attention")
    else:
        main, local = dict(params), None
    main.setdefault("rope_theta", cfg.get("rope_theta", arch.default_rope_theta))
    if cfg.get("partial_rotary_factor") is not None:
        main.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if cfg.get("original_max_position_embeddings") is not None:
        # Phi-3 keeps the pretraining context at the top level; HF gives it priority.
        main["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if local is None and arch.model_type == "gemma3_text":
        local = {"rope_theta": 10000.0}
    return main, local


def _rope_type(rope: dict) -> str:
    kind = rope.get("rope_type", rope.get("type", "default"))
    return "longrope" if kind == "su" else kind


def _rope_fields(cfg: dict, arch: Architecture, head_dim: int) -> dict:
    main, local = _rope_dicts(cfg, arch)
    for rope in (main, local or {}):
        unknown = sorted(set(rope) - _ROPE_KEYS)
        if unknown:
            raise ConfigError(f"rope parameters jaxserve does not implement: {', '.join(unknown)}")
    if local is not None and _rope_type(local) != "default":
        raise ConfigError(f"rope scaling {_rope_type(local)!r} on sliding layers is not supported")
    rotary_dim = int(head_dim * main.get("partial_rotary_factor", 1.0))
    out = {"rope_theta": float(main["rope_theta"]),
           "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
           "local_rope_theta": None if local is None else float(local["rope_theta"]),
           "rope_scaling": None}
    kind = _rope_type(main)
    if kind == "default":
        return out
    max_pos = cfg.get("max_position_embeddings", 2048)
    original = main.get("original_max_position_embeddings", max_pos)
    if kind == "linear":
        scaling = RopeScaling(rope_type="linear", factor=main["factor"])
    elif kind == "llama3":
        scaling = RopeScaling(
            rope_type="llama3", factor=main["factor"], low_freq_factor=main["low_freq_factor"],
            high_freq_factor=main["high_freq_factor"], original_max_position_embeddings=original)
    elif kind == "longrope":
        factor = main.get("factor") or max_pos / original
        attention_factor = main.get("attention_factor")
        if attention_factor is None:
            attention_factor = (1.0 if factor <= 1.0 else
                                math.sqrt(1 + math.log(factor) / math.log(original)))
        scaling = RopeScaling(
            rope_type="longrope", factor=factor, original_max_position_embeddings=original,
            short_factor=tuple(main["short_factor"]), long_factor=tuple(main["long_factor"]),
            attention_factor=attention_factor)
    elif kind == "yarn":
        # HF's _compute_yarn_parameters: the factor defaults to the context's growth; the cos /
        # sin factor from mscale / mscale_all_dim when both are given.
        factor = main.get("factor") or max_pos / original
        attention_factor = main.get("attention_factor")
        mscale, mscale_all_dim = main.get("mscale"), main.get("mscale_all_dim")
        if attention_factor is None:
            attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else _yarn_mscale(factor))
        scaling = RopeScaling(
            rope_type="yarn", factor=factor, original_max_position_embeddings=original,
            attention_factor=attention_factor, beta_fast=float(main.get("beta_fast") or 32.0),
            beta_slow=float(main.get("beta_slow") or 1.0), truncate=bool(main.get("truncate", True)))
    else:
        scaling = RopeScaling(rope_type=kind)  # refuses the type, naming what is supported
    return {**out, "rope_scaling": scaling}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def config_from_hf(cfg: dict, name: str, dtype: str = "float32") -> ModelConfig:
    """ModelConfig of an HF config.json (parsed), or a ConfigError naming what is not served."""
    cfg = text_config(cfg)
    arch = architecture(cfg.get("model_type"))
    _check_keys(cfg, arch)
    if not mxfp4.is_mxfp4(cfg.get("quantization_config")):
        fp8.block_size(cfg.get("quantization_config"))  # dequantized at load, or refused here
    heads = cfg["num_attention_heads"]
    # (DeepSeek-V3: the rotated dims of a head, as HF's config sets head_dim.)
    head_dim = cfg.get("head_dim") or cfg.get("qk_rope_head_dim") or cfg["hidden_size"] // heads
    if cfg.get("attention_bias") and not arch.attention_bias:
        # Llama-style attention_bias also biases o_proj, which the decoder does not have.
        raise ConfigError(f"attention_bias is not supported for {arch.model_type}")
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    fields = {
        "hidden_act": _activation(cfg.get("hidden_act") or "silu"),
        **_rope_fields(cfg, arch, head_dim),
        **_sliding_layers(cfg, lambda i: True),
        **arch.fields(cfg),
    }
    return ModelConfig(
        name=name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings",
                                    arch.model_type in ("gemma2", "gemma3_text")),
        attention_bias=arch.attention_bias,
        dtype=dtype,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        architecture=arch.model_type,
        **fields,
    )

"""HF checkpoint names -> jaxserve's parameter tree; every source format goes through here.

HF stores torch Linear weights as [out, in]; the model wants [in, out] with the head axes split out
(see jaxserve.executor.models.decoder). Loaders hand tensors by HF name, so GGUF only has to rename
its own.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import WeightsError
from jaxserve.weights.architectures import architecture
from jaxserve.weights.mla_layout import attention_from_hf as mla_attention_from_hf
from jaxserve.weights.moe_layout import moe_params_from_hf

GetTensor = Callable[[str], np.ndarray]


def _layer(config: ModelConfig, get: GetTensor, i: int,
           skip: frozenset[str]) -> dict[str, np.ndarray]:
    H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    pre = f"model.layers.{i}."
    attn, mlp = pre + "self_attn.", pre + "mlp."
    if config.mla is not None:  # DeepSeek-V3: latent attention; its MLPs are the MoE groups'
        return {"input_norm": get(pre + "input_layernorm.weight"),
                **mla_attention_from_hf(config, get, attn),
                "post_attention_norm": get(pre + "post_attention_layernorm.weight")}
    if architecture(config.architecture).fused_projections:
        # Phi-3: q, k, v stacked in qkv_proj's rows, gate then up in gate_up_proj's.
        q, k, v = np.split(get(attn + "qkv_proj.weight"), [Hq * D, (Hq + Hkv) * D])
        gate, up = np.split(get(mlp + "gate_up_proj.weight"), 2)
    elif not skip:
        q, k, v = (get(attn + f"{n}_proj.weight") for n in "qkv")
        if not config.num_experts:  # (a mixture of experts' MLPs: jaxserve.weights.moe_layout)
            gate, up = get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")
    out = {"input_norm": get(pre + "input_layernorm.weight")}
    if not skip:  # else the caller keeps the seven projections as they are (GGUF blocks)
        out.update(q_proj=q.T.reshape(H, Hq, D), k_proj=k.T.reshape(H, Hkv, D),
                   v_proj=v.T.reshape(H, Hkv, D),
                   o_proj=get(attn + "o_proj.weight").T.reshape(Hq, D, H))
    if not config.num_experts and not skip:
        out.update(gate_proj=gate.T, up_proj=up.T, down_proj=get(mlp + "down_proj.weight").T)
    if config.sandwich_norms:
        # Gemma's post_attention_layernorm norms the attention's output; its pre-MLP norm is
        # pre_feedforward_layernorm (the decoder's post_attention_norm, named after Llama's).
        out["attn_output_norm"] = get(pre + "post_attention_layernorm.weight")
        out["post_attention_norm"] = get(pre + "pre_feedforward_layernorm.weight")
        out["mlp_output_norm"] = get(pre + "post_feedforward_layernorm.weight")
    else:
        out["post_attention_norm"] = get(pre + "post_attention_layernorm.weight")
    if config.qk_norm:
        out["q_norm"] = get(attn + "q_norm.weight")
        out["k_norm"] = get(attn + "k_norm.weight")
    if config.o_proj_bias:
        out["o_bias"] = get(attn + "o_proj.bias")
    if config.attention_sinks:
        out["sinks"] = get(attn + "sinks")
    if config.attention_bias:
        out["q_bias"] = get(attn + "q_proj.bias").reshape(Hq, D)
        out["k_bias"] = get(attn + "k_proj.bias").reshape(Hkv, D)
        out["v_bias"] = get(attn + "v_proj.bias").reshape(Hkv, D)
    return out


def params_from_hf(config: ModelConfig, get: GetTensor, source: str,
                   skip: frozenset[str] = frozenset()) -> dict:
    """Build the parameter tree (host numpy, each in config.param_dtype: the model's dtype, or
    weight_dtype for the matmul weights the CPU kernels read) from HF-named tensors.

    `source` names the file or directory in errors (a missing or mis-shaped tensor). `skip`:
    parameters the caller fills itself and that are not read (GGUF blocks kept as they are:
    all seven projections or none, embed_tokens, lm_head).
    """
    def fetch(name: str) -> np.ndarray:
        try:
            return get(name)
        except KeyError:
            raise WeightsError(f"{source}: tensor {name!r} is missing") from None

    try:
        layer_skip = skip & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"}
        layers = [_layer(config, fetch, i, frozenset(layer_skip))
                  for i in range(config.num_layers)]
        params = {
            "norm": fetch("model.norm.weight").reshape(config.hidden_size),
            "layers": {k: np.stack([layer[k] for layer in layers]) for k in layers[0]},
        }
        if "embed_tokens" not in skip:
            params["embed_tokens"] = fetch("model.embed_tokens.weight").reshape(
                config.vocab_size, config.hidden_size)
        if config.num_experts:
            params.update(moe_params_from_hf(config, fetch))
        if not config.tie_word_embeddings and "lm_head" not in skip:
            params["lm_head"] = fetch("lm_head.weight").T.reshape(config.hidden_size,
                                                                  config.vocab_size)
    except ValueError as e:  # a reshape that does not fit: the tensor disagrees with the config
        raise WeightsError(f"{source}: a tensor's shape does not match its config ({e})") from None
    return {group: {name: _cast(w, config.param_dtype(group, name)) for name, w in v.items()}
            if isinstance(v, dict) else _cast(v, config.dtype) for group, v in params.items()}


def _cast(w: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes  # a JAX dependency; numpy has no bfloat16 of its own

    return np.ascontiguousarray(w, ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

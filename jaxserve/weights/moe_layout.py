"""HF checkpoint names of the mixture-of-experts MLPs -> jaxserve's `moe` / `dense_mlp` groups
(see jaxserve.executor.models.moe): the checkpoints store each expert's projections as a tensor
of its own ([out, in], as torch Linear), stacked here per layer into [S, E, in, out]; gpt-oss's are
stacked already ([E, in, out], MXFP4 ones dequantized by jaxserve.weights.mxfp4), gate and up
interleaved column by column in one gate_up_proj, all with biases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.config import ModelConfig

# Per family: the block's name in a layer, and its experts' gate / up / down projections' names
# (also how GGUF's stacked experts are named: jaxserve.weights.gguf).
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _gpt_oss(get: Callable[[str], np.ndarray], i: int) -> dict[str, np.ndarray]:
    pre = f"model.layers.{i}.mlp."
    gate_up, bias = get(pre + "experts.gate_up_proj"), get(pre + "experts.gate_up_proj_bias")
    return {"router": get(pre + "router.weight").T, "router_bias": get(pre + "router.bias"),
            "gate_proj": gate_up[..., 0::2], "up_proj": gate_up[..., 1::2],
            "gate_bias": bias[..., 0::2], "up_bias": bias[..., 1::2],
            "down_proj": get(pre + "experts.down_proj"),
            "down_bias": get(pre + "experts.down_proj_bias")}


def moe_params_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray]) -> dict:
    if config.architecture == "gpt_oss":
        return {"moe": _stack([_gpt_oss(get, i) for i in config.sparse_layers])}
    block, (gate, up, down) = EXPERT_NAMES[config.architecture]
    experts = range(config.num_experts)

    def sparse(i: int) -> dict[str, np.ndarray]:
        pre = f"model.layers.{i}.{block}."

        def stacked(name: str) -> np.ndarray:
            return np.stack([get(f"{pre}experts.{e}.{name}.weight").T for e in experts])

        return {"router": get(pre + "gate.weight").T, "gate_proj": stacked(gate),
                "up_proj": stacked(up), "down_proj": stacked(down)}

    def dense(i: int) -> dict[str, np.ndarray]:
        pre = f"model.layers.{i}.mlp."
        return {name: get(f"{pre}{name}.weight").T for name in ("gate_proj", "up_proj",
                                                                  "down_proj")}

    def shared(i: int) -> dict[str, np.ndarray]:  # DeepSeek-V3's shared experts
        pre = f"model.layers.{i}.{block}.shared_experts."
        return {name: get(f"{pre}{name}.weight").T for name in ("gate_proj", "up_proj",
                                                                  "down_proj")}

    out = {"moe": _stack([sparse(i) for i in config.sparse_layers])}
    if config.moe_scoring == "sigmoid":
        out["moe"]["score_correction_bias"] = np.stack([
            get(f"model.layers.{i}.{block}.gate.e_score_correction_bias")
            for i in config.sparse_layers])
    if config.num_shared_experts:
        out["shared_mlp"] = _stack([shared(i) for i in config.sparse_layers])
    if config.dense_layers:
        out["dense_mlp"] = _stack([dense(i) for i in config.dense_layers])
    return out


def _stack(layers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([layer[k] for layer in layers]) for k in layers[0]}

"""HF checkpoint names of latent attention (DeepSeek-V3) -> the decoder layer's MLA parameters
(jaxserve.executor.models.mla). torch Linear weights are [out, in]: transposed, the head axes
split out, and the rope dims of the q and kv_a projections de-interleaved where the checkpoint
rotates pairs (rope_interleave): HF rotates (x0, x1), (x2, x3), ... and returns the evens' and
odds' results concatenated, which is the rotate-half rotation of [evens, odds]."""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxserve.config import ModelConfig


def _deinterleave(w: np.ndarray, rope_dims: int) -> np.ndarray:
    """w [..., rope_dims] with the rope dims as pairs -> [..., evens, odds]."""
    return np.concatenate([w[..., 0:rope_dims:2], w[..., 1:rope_dims:2]], axis=-1)


def attention_from_hf(config: ModelConfig, get: Callable[[str], np.ndarray],
                      prefix: str) -> dict[str, np.ndarray]:
    """One layer's MLA parameters from the tensors under `prefix` (model.layers.{i}.self_attn.)."""
    m, H, Hq = config.mla, config.hidden_size, config.num_heads
    Dn, Dr, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank

    def rope_last(w: np.ndarray) -> np.ndarray:
        if not m.rope_interleave:
            return w
        return np.concatenate([w[..., :-Dr], _deinterleave(w[..., -Dr:], Dr)], axis=-1)

    out = {}
    if m.q_lora_rank is None:
        out["q_proj"] = rope_last(get(prefix + "q_proj.weight").T.reshape(H, Hq, Dn + Dr))
    else:
        out["q_a_proj"] = get(prefix + "q_a_proj.weight").T
        out["q_a_norm"] = get(prefix + "q_a_layernorm.weight")
        out["q_b_proj"] = rope_last(
            get(prefix + "q_b_proj.weight").T.reshape(m.q_lora_rank, Hq, Dn + Dr))
    out["kv_a_proj"] = rope_last(get(prefix + "kv_a_proj_with_mqa.weight").T)
    out["kv_a_norm"] = get(prefix + "kv_a_layernorm.weight")
    out["kv_b_proj"] = get(prefix + "kv_b_proj.weight").T.reshape(R, Hq, Dn + m.v_head_dim)
    out["o_proj"] = get(prefix + "o_proj.weight").T.reshape(Hq, m.v_head_dim, H)
    return out

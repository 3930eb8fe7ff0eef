"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), the attention of a decoder layer whose
ModelConfig has `mla` (jaxserve.config.MlaConfig), over the compressed paged cache.

Per token the layer computes one latent of kv_lora_rank (kv_a_proj_with_mqa, then kv_a_layernorm)
and one rope key of qk_rope_head_dim shared by all heads; the cache stores exactly that row
[latent, rope key] per token and layer, instead of per-head K and V (576 values a token for
DeepSeek-V3 against 128 heads x (192 + 128)). Attention runs with the weights absorbed, for
prefill and decode alike: each head's non-rotated query is taken through kv_b_proj's key part
into latent space, so its score against a cached token is one dot product with the row; the
softmax-weighted latents go through kv_b_proj's value part, then o_proj
(jaxserve.kernels.attention.mla).

Parameters (per layer, in the decoder's stacks; names after HF's): q_a_proj [H, Rq], q_a_norm
[Rq], q_b_proj [Rq, heads, Dn + Dr] (or q_proj [H, heads, Dn + Dr] without a q rank), kv_a_proj
[H, R + Dr], kv_a_norm [R], kv_b_proj [R, heads, Dn + Dv], o_proj [heads, Dv, H]. The rope dims of
q_b_proj / q_proj and kv_a_proj are in rotate-half order: the loader de-interleaves checkpoints
that store them as pairs (rope_interleave), which HF's rotation of pairs equals exactly.

Under tensor parallelism the heads shard (q_b_proj, kv_b_proj, o_proj) and the latent cache is
replicated: every device holds every token's row, as each head needs all of it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.executor import sharding
from jaxserve.executor.batch_plan import BatchPlan
from jaxserve.kernels.attention import mla as mla_kernel

Norm = Callable[[jax.Array, jax.Array], jax.Array]  # (x, weight) -> RMSNorm(x) * weight
Rope = Callable[[jax.Array], jax.Array]  # x [T, heads, Dr] -> rotated by the batch's positions


def param_specs(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], int]]:
    """name -> (shape, logical axes, fan-in; 0 for a norm's weight) of one layer's parameters."""
    c, m = config, config.mla
    H, Hq = c.hidden_size, c.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {}
    if m.q_lora_rank is None:
        out["q_proj"] = ((H, Hq, qk), ("embed", "heads", "head_dim"), H)
    else:
        out["q_a_proj"] = ((H, m.q_lora_rank), ("embed", "latent"), H)
        out["q_a_norm"] = ((m.q_lora_rank,), ("latent",), 0)
        out["q_b_proj"] = ((m.q_lora_rank, Hq, qk), ("latent", "heads", "head_dim"), m.q_lora_rank)
    out["kv_a_proj"] = ((H, m.latent_dim), ("embed", "latent"), H)
    out["kv_a_norm"] = ((m.kv_lora_rank,), ("latent",), 0)
    out["kv_b_proj"] = ((m.kv_lora_rank, Hq, m.qk_nope_head_dim + m.v_head_dim),
                        ("latent", "heads", "head_dim"), m.kv_lora_rank)
    out["o_proj"] = ((Hq, m.v_head_dim, H), ("heads", "head_dim", "embed"), Hq * m.v_head_dim)
    return out


# HF's DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep (not rms_norm_eps).
LATENT_NORM_EPS = 1e-6


def attention(config: ModelConfig, mesh: jax.sharding.Mesh | None, p: dict, h: jax.Array,
              layer: jax.Array, batch: BatchPlan, latent_cache: jax.Array, *, norm: Norm,
              rope: Rope, precision: jax.lax.Precision,
              initializing: bool = False) -> tuple[jax.Array, jax.Array]:
    """h [T, H] (input-normed) -> (the layer's attention output [T, H], latent_cache)."""
    m = config.mla
    R, Dn = m.kv_lora_rank, m.qk_nope_head_dim
    dot = lambda x, w, n=1: jnp.tensordot(x, w, n, precision=precision)  # noqa: E731
    if m.q_lora_rank is None:
        q = dot(h, p["q_proj"])
    else:
        q = dot(norm(dot(h, p["q_a_proj"]), p["q_a_norm"]), p["q_b_proj"])
    q_nope, q_rope = jnp.split(q, [Dn], axis=-1)
    latent, k_rope = jnp.split(dot(h, p["kv_a_proj"]), [R], axis=-1)
    rows = jnp.concatenate([norm(latent, p["kv_a_norm"]), rope(k_rope[:, None, :])[:, 0]], -1)
    w_uk, w_uv = jnp.split(p["kv_b_proj"], [Dn], axis=-1)
    # Absorbed: q_nope . (w_uk latent) = (w_uk^T q_nope) . latent, per head.
    q_latent = jnp.einsum("thd,rhd->thr", q_nope, w_uk, precision=precision)
    q = jnp.concatenate([q_latent, rope(q_rope)], axis=-1)
    if initializing:  # parameters need only shapes (as the decoder's own init)
        out = q[..., :R]
    else:
        out, latent_cache = _paged(config, mesh, q, rows, latent_cache, batch, layer)
    out = jnp.einsum("thr,rhv->thv", out.astype(h.dtype), w_uv, precision=precision)
    return dot(out, p["o_proj"], 2), latent_cache


def _paged(config: ModelConfig, mesh, q, rows, latent_cache, batch: BatchPlan, layer):
    """Write this step's rows into the layer's pages, attend: (latents [T, heads, R], cache)."""
    m = config.mla

    def attend(q, rows, latent_cache, batch, layer):
        num_pages, page_size = latent_cache.shape[0] // config.num_layers, latent_cache.shape[1]
        latent_cache = mla_kernel.write_latent(
            latent_cache, rows, batch.slot_mapping + layer * (num_pages * page_size))
        out = mla_kernel.mla_ragged_paged_attention(
            q, latent_cache, batch.kv_lens, batch.page_indices + layer * num_pages,
            batch.cu_q_lens, batch.num_seqs, kv_lora_rank=m.kv_lora_rank,
            sm_scale=m.softmax_scale)
        return out, latent_cache

    if mesh is None:
        return attend(q, rows, latent_cache, batch, layer)
    # Each device attends its own heads over the whole (replicated) cache, writing the same rows.
    heads = (PartitionSpec(None, sharding.MODEL, None)
             if config.num_heads % mesh.shape[sharding.MODEL] == 0 else PartitionSpec())
    replicated = PartitionSpec()
    return jax.shard_map(attend, mesh=mesh,
                         in_specs=(heads, replicated, replicated, replicated, replicated),
                         out_specs=(heads, replicated), check_vma=False)(
        q, rows, latent_cache, batch, layer)

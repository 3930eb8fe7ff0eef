"""Latent attention over the paged latent cache (multi-head latent attention, DeepSeek-V2/V3),
with the weights absorbed: the XLA path, and the write that fills the cache. The contract is
mla_reference.py's (the float64 oracle this path is tested against).

With kv_b_proj's key part absorbed into the query and its value part applied after (by the model,
jaxserve.executor.models.mla), every head attends over the same cached rows: multi-query
attention whose key is a cached row [latent, rope key] and whose value is its latent. So this is
ragged paged attention with one KV head whose value is a prefix of its key, and it reuses the
XLA path's machinery (xla.py: query items, KV blocks walked per group, the online softmax): query
blocks of PREFILL_Q_BLOCK rows for prefill chunks, one query per item for decodes, each item
walking only the KV blocks its queries see. Prefill runs absorbed too (the same function for
every step, so chunked prefill and prefix caching see one computation); what that costs against
expanding the latent per head for long prompts is noted in docs/models.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxserve.kernels.attention import xla
from jaxserve.kernels.attention.mla_validate import validate_mla_inputs
from jaxserve.shapes import cdiv


def write_latent(latent_cache, rows, slot_mapping):
    """Scatter this step's rows [T, L] (latent, rope key) into the cache [P, page_size, L] at
    `slot_mapping` (page * page_size + offset); slots outside the cache are dropped."""
    P, ps, L = latent_cache.shape
    if rows.shape != (slot_mapping.shape[0], L):
        raise ValueError(f"write_latent: rows {rows.shape}, slot_mapping {slot_mapping.shape} do "
                         f"not fit a cache of shape {latent_cache.shape}")
    flat = latent_cache.reshape(P * ps, L).at[slot_mapping].set(
        rows.astype(latent_cache.dtype), mode="drop")
    return flat.reshape(P, ps, L)


def _attend(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, kv_lora_rank, sm_scale,
            q_block, items_per_step, kv_block_tokens, include):
    T, H, L = q.shape
    ps = cache.shape[1]
    S = page_indices.shape[0]
    page_indices, pages_per_block, blk_tokens, num_blocks = xla._kv_blocks(
        page_indices, ps, kv_block_tokens)
    num_items = S if q_block == 1 else cdiv(T, q_block) + S
    num_items = cdiv(num_items, items_per_step) * items_per_step
    items = xla.query_items(cu_q_lens, kv_lens, num_seqs[0], q_block=q_block,
                            num_items=num_items, sliding_window=None, block_tokens=blk_tokens,
                            include=include)
    # Longest first, as xla.py: items of like length share a group's KV walk.
    order = jnp.argsort(-items.blk_hi, stable=True)
    items = items._replace(**{f: getattr(items, f)[order] for f in xla.QueryItems._fields
                              if f != "num_live"})
    r = jnp.arange(q_block)
    row_ok = r[None, :] < items.rows[:, None]
    row_ids = jnp.where(row_ok, items.start[:, None] + r[None, :], T)  # T: scatters drop
    qf = q.astype(jnp.float32) * sm_scale

    def groups_of(width, first):
        def group(g, out):
            sl = lambda x: lax.dynamic_slice_in_dim(x, first + g * width, width)  # noqa: E731
            g_rows, g_ok = sl(row_ids), sl(row_ok)
            qg = jnp.take(qf, g_rows, axis=0, mode="clip")  # [I, Qb, H, L]
            q_pos = sl(items.first_pos)[:, None] + r[None, :]
            tables = page_indices[sl(items.seq)]

            def kv_step(b, carry):
                pages = lax.dynamic_slice_in_dim(tables, b * pages_per_block, pages_per_block,
                                                 axis=1)
                kv = cache[pages].reshape(width, pages_per_block * ps, L).astype(jnp.float32)
                k_pos = b * pages_per_block * ps + jnp.arange(pages_per_block * ps)
                s = jnp.einsum("iqhl,ikl->iqhk", qg, kv, precision=lax.Precision.HIGHEST)
                mask = xla._visible(k_pos, q_pos, None)[:, :, None, :]
                return xla._softmax_step(carry, s, mask, kv[..., :kv_lora_rank],
                                         "iqhk,ikr->iqhr", None)

            init = xla._softmax_init((width, q_block, H), kv_lora_rank)
            lo = jnp.min(jnp.where(sl(items.rows) > 0, sl(items.blk_lo), num_blocks))
            _, l, acc = lax.fori_loop(lo, jnp.max(sl(items.blk_hi)), kv_step, init)
            o = acc / jnp.where(l > 0, l, 1.0)[..., None]
            o = jnp.where(g_ok[:, :, None, None], o, 0.0).reshape(-1, H, kv_lora_rank)
            return out.at[g_rows.reshape(-1)].set(o.astype(out.dtype), mode="drop")

        return group

    return xla._in_groups(items.num_live, items_per_step, groups_of,
                          jnp.zeros((T, H, kv_lora_rank), q.dtype))


def mla_ragged_paged_attention(q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               kv_lora_rank: int, sm_scale: float):
    """Latent attention of ragged queries over the paged latent cache (contract:
    mla_reference.py); rows past cu_q_lens[num_seqs] come back as zeros. Decodes take one query
    per item, prefill chunks blocks of queries; a batch of only decodes runs the decode path
    alone."""
    validate_mla_inputs(q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                        kv_lora_rank=kv_lora_rank)
    args = (q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kwargs = dict(kv_lora_rank=kv_lora_rank, sm_scale=sm_scale)

    def decodes():
        return _attend(*args, **kwargs, q_block=1, items_per_step=xla.DECODE_SEQS_PER_STEP,
                       kv_block_tokens=xla.DECODE_KV_BLOCK_TOKENS, include=q_lens <= 1)

    def mixed():
        # Each path writes only its own sequences' rows and leaves the others 0.
        return decodes() + _attend(
            *args, **kwargs, q_block=xla.PREFILL_Q_BLOCK, items_per_step=xla.PREFILL_ITEMS_PER_STEP,
            kv_block_tokens=xla.PREFILL_KV_BLOCK_TOKENS, include=q_lens > 1)

    if q.shape[0] == 1:
        return decodes()
    return lax.cond(jnp.max(q_lens) <= 1, decodes, mixed)

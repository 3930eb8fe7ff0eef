"""Pallas TPU (Mosaic) ragged paged attention.

Grid: one program per query item (see xla.query_items), all KV heads inside it, so each
page is one contiguous DMA of [page_size, 2 * Hkv, D] that serves K and V of every head. The item
metadata and the page table are scalar-prefetched into SMEM; the cache stays in HBM (memory space
ANY) and the kernel copies the item's pages block by block into a two-slot VMEM buffer, starting
block b + 1's DMAs before computing block b. Softmax is online, accumulated in f32 VMEM scratch.

Queries and outputs travel in an item-major layout [items, Hkv, q_block * G, D] built by the
wrapper, so every program owns its output block and items of neighbouring sequences never
overwrite each other's rows.

Attention sinks (gpt-oss) come in as one more block, each row's sink logit [Hkv, q_block * G, 1],
folded into the online softmax's state after the last KV block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.kernels.attention.xla import query_items
from jaxserve.shapes import cdiv

Q_BLOCK = 16
KV_BLOCK_TOKENS = 128

_MASKED = -1e30


def _kernel(seq_ref, first_ref, rows_ref, lo_ref, hi_ref, tables_ref,  # scalar prefetch (SMEM)
            q_ref, cache_hbm, *refs, q_block, group, pages_per_block, pages_per_seq,
            sliding_window, soft_cap, with_sinks):
    sink_ref, refs = (refs[0], refs[1:]) if with_sinks else (None, refs)
    o_ref, kv_buf, sems, m_ref, l_ref, acc_ref = refs
    item = pl.program_id(0)
    seq, first_pos, rows = seq_ref[item], first_ref[item], rows_ref[item]
    blk_lo, blk_hi = lo_ref[item], hi_ref[item]
    Hkv, M, D = q_ref.shape
    ps = kv_buf.shape[2]
    blk = pages_per_block * ps

    def copies(b, slot):
        return [pltpu.make_async_copy(
            cache_hbm.at[tables_ref[seq * pages_per_seq + b * pages_per_block + j]],
            kv_buf.at[slot, j], sems.at[slot, j]) for j in range(pages_per_block)]

    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(blk_lo < blk_hi)
    def _():
        for c in copies(blk_lo, 0):
            c.start()

    q_pos = first_pos + lax.broadcasted_iota(jnp.int32, (M, blk), 0) // group

    def body(b, _):
        slot = (b - blk_lo) % 2

        @pl.when(b + 1 < blk_hi)
        def _():
            for c in copies(b + 1, 1 - slot):
                c.start()

        for c in copies(b, slot):
            c.wait()
        kv = kv_buf[slot].reshape(blk, 2 * Hkv, D)
        k_pos = b * blk + lax.broadcasted_iota(jnp.int32, (M, blk), 1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        for h in range(Hkv):
            k, v = kv[:, 2 * h, :], kv[:, 2 * h + 1, :]
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, _MASKED)
            m_prev = m_ref[h]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p.astype(v.dtype), v,
                                                      preferred_element_type=jnp.float32)
            m_ref[h] = m_new
        return 0

    lax.fori_loop(blk_lo, blk_hi, body, 0)
    l, acc = l_ref[...], acc_ref[...]
    if sink_ref is not None:  # the sink joins the denominator and carries no value
        sink, m = sink_ref[...], m_ref[...]
        top = jnp.maximum(m, sink)
        scale = jnp.exp(m - top)
        l, acc = l * scale + jnp.exp(sink - top), acc * scale
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None, interpret=False,
                           q_block=Q_BLOCK, kv_block_tokens=KV_BLOCK_TOKENS):
    T, Hq, D = q.shape
    P, ps, H2, _ = kv_cache.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    S, pages_per_seq = page_indices.shape
    pages_per_block = max(1, kv_block_tokens // ps)
    padded_pages = cdiv(pages_per_seq, pages_per_block) * pages_per_block
    M = q_block * G

    num_items = cdiv(T, q_block) + S
    items = query_items(cu_q_lens, kv_lens, num_seqs[0], q_block=q_block, num_items=num_items,
                        sliding_window=sliding_window, block_tokens=pages_per_block * ps)
    tables = jnp.pad(page_indices, ((0, 0), (0, padded_pages - pages_per_seq))).reshape(-1)

    # Item-major queries [W, Hkv, q_block * G, D]; rows past an item's end are clamped copies
    # whose outputs are never read back.
    r = jnp.arange(q_block)
    rows = jnp.minimum(items.start[:, None] + r[None, :], T - 1)  # [W, q_block]
    qi = (q * sm_scale).astype(q.dtype)[rows].reshape(num_items, q_block, Hkv, G, D)
    qi = qi.transpose(0, 2, 1, 3, 4).reshape(num_items, Hkv, M, D)

    kernel = functools.partial(_kernel, q_block=q_block, group=G,
                               pages_per_block=pages_per_block, pages_per_seq=padded_pages,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               with_sinks=sinks is not None)
    block = pl.BlockSpec((None, Hkv, M, D), lambda i, *_: (i, 0, 0, 0))
    extra, extra_specs = (), []
    if sinks is not None:  # row m of a head's tile is query head m % G of its group
        extra = (jnp.tile(sinks.astype(jnp.float32).reshape(Hkv, 1, G), (1, q_block, 1))
                 .reshape(Hkv, M, 1),)
        extra_specs = [pl.BlockSpec((Hkv, M, 1), lambda i, *_: (0, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_items,),
            in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), *extra_specs],
            out_specs=block,
            scratch_shapes=[
                pltpu.VMEM((2, pages_per_block, ps, H2, D), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((2, pages_per_block)),
                pltpu.VMEM((Hkv, M, 1), jnp.float32),
                pltpu.VMEM((Hkv, M, 1), jnp.float32),
                pltpu.VMEM((Hkv, M, D), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct((num_items, Hkv, M, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(items.seq, items.first_pos, items.rows, items.blk_lo, items.blk_hi, tables, qi, kv_cache,
      *extra)

    # Back to flat rows: row t lives in item item_of[t] at offset t - start.
    out = out.reshape(num_items, Hkv, q_block, G, D).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_items * q_block, Hq, D)
    t = jnp.arange(T)
    seq_of = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, S - 1)
    blocks = (cu_q_lens[1:] - cu_q_lens[:-1] + q_block - 1) // q_block
    blocks = jnp.where(jnp.arange(S) < num_seqs[0], blocks, 0)
    first_item = jnp.cumsum(blocks) - blocks
    off = t - cu_q_lens[seq_of]
    flat = (first_item[seq_of] + off // q_block) * q_block + off % q_block
    live = t < cu_q_lens[num_seqs[0]]
    return jnp.where(live[:, None, None], out[jnp.where(live, flat, 0)], 0)

"""Pallas GPU (Triton lowering) ragged paged attention: mixed prefill + decode in one launch.

Grid: (query item, KV head). An item is a block of up to `q_block` consecutive queries of one
sequence (see xla.query_items); its program loads the item's queries for all `G` query heads
of its KV head as one [q_block * G, D] tile, so GQA shares every K/V load, and walks only the KV
blocks that tile can see, gathering `pages_per_block` pages of its sequence per step. Softmax is
online in f32 and the dots accumulate in f32.

The cache is passed twice with BlockSpecs that squeeze axis 2 at 2h (K) and 2h + 1 (V), so the
kernel sees plain [pages, page_size, D] refs of its head and gathers pages by index.

Attention sinks (gpt-oss) need no change inside the kernel: with the log-sum-exp L of a query's
scores (the split path's), out * L / (L + e^sink) = out * sigmoid(lse - sink) puts the sink in
the denominator, so a call with sinks takes that path and scales its merged output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.attention.xla import query_items
from jaxserve.shapes import cdiv

# Rows of the query tile (q_block * padded G; Triton's dot needs every dim >= 16) and bytes of
# one K (or V) tile: sized so the pipelined tiles fit an H100's shared memory for D up to 128.
TILE_ROWS = 64
KV_TILE_BYTES = 16 * 1024
NUM_WARPS = 4
NUM_STAGES = 2
# Programs (items x KV heads x KV splits) worth launching: a few waves over an H100's 132 SMs.
TARGET_PROGRAMS = 4096

_MASKED = float(jnp.finfo(jnp.float32).min)


def _kernel(seq_ref, start_ref, rows_ref, first_ref, lo_ref, hi_ref, tables_ref,  # item metadata
            q_ref, k_ref, v_ref, o_ref, *lse_ref, q_block, group, pages_per_block, num_splits,
            sliding_window, soft_cap, precision):
    item = pl.program_id(0)
    seq, start, rows = seq_ref[item], start_ref[item], rows_ref[item]
    first_pos, blk_lo, blk_hi = first_ref[item], lo_ref[item], hi_ref[item]
    ps, D = k_ref.shape[1], k_ref.shape[2]
    blk = pages_per_block * ps
    M = q_block * group

    q = q_ref[pl.ds(start, q_block)].reshape(M, D)
    q_pos = first_pos + lax.broadcasted_iota(jnp.int32, (M, blk), 0) // group

    def page_ids(b):
        return tables_ref[seq, pl.ds(b * pages_per_block, pages_per_block)]

    def body(b, carry):
        # Page ids travel one step ahead in the carry, so this step's K/V gather does not wait
        # on a dependent load of its own page ids.
        acc, m, l, pages = carry
        next_pages = page_ids(b + 1)
        k = k_ref[pages].reshape(blk, D)
        v = v_ref[pages].reshape(blk, D)
        s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        k_pos = b * blk + lax.broadcasted_iota(jnp.int32, (M, blk), 1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l, next_pages

    init = (jnp.zeros((M, D), jnp.float32), jnp.full((M,), _MASKED, jnp.float32),
            jnp.zeros((M,), jnp.float32))
    # KV split: this program takes one contiguous share of the item's KV blocks.
    per_split = (blk_hi - blk_lo + num_splits - 1) // num_splits
    b0 = blk_lo + pl.program_id(2) * per_split
    acc, m, l, _ = lax.fori_loop(b0, jnp.minimum(b0 + per_split, blk_hi), body,
                                 init + (page_ids(jnp.minimum(b0, blk_hi)),))
    o = (acc / jnp.where(l > 0, l, 1.0)[:, None]).reshape(q_block, group, D)
    row_ok = lax.broadcasted_iota(jnp.int32, (q_block, group, D), 0) < rows
    plgpu.store(o_ref.at[pl.ds(start, q_block)], o.astype(o_ref.dtype), mask=row_ok)
    if lse_ref:
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        plgpu.store(lse_ref[0].at[pl.ds(start, q_block)], lse.reshape(q_block, group),
                    mask=lax.broadcasted_iota(jnp.int32, (q_block, group), 0) < rows)


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None, interpret=False,
                           tile_rows=None, kv_block_tokens=None,
                           num_warps=NUM_WARPS, num_stages=NUM_STAGES, num_splits=None):
    """Block sizes default to the values tuned on an H100 (benchmarks/kernels.py sweeps them).

    num_splits (KV splits per item, merged by log-sum-exp afterwards) defaults to enough programs
    to fill the GPU when the batch has few query items, e.g. decode; 1 for large prefills.
    """
    T, Hq, D = q.shape
    P, ps, H2, _ = kv_cache.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    S, pages_per_seq = page_indices.shape
    itemsize = jnp.dtype(q.dtype).itemsize
    tile_rows = tile_rows or max(16, TILE_ROWS * 2 // itemsize)
    kv_block_tokens = kv_block_tokens or max(16, KV_TILE_BYTES // (D * itemsize))
    Gp = pl.next_power_of_2(G)  # Triton tiles are powers of two: padded heads are zeros
    q_block = max(1, tile_rows // Gp)
    pages_per_block = max(1, kv_block_tokens // ps)
    blk = pages_per_block * ps
    num_blocks = cdiv(pages_per_seq, pages_per_block)

    num_items = cdiv(T, q_block) + S
    if num_splits is None:
        fill = max(1, TARGET_PROGRAMS // (num_items * Hkv))
        num_splits = min(1 << (fill.bit_length() - 1), num_blocks)
    items = query_items(cu_q_lens, kv_lens, num_seqs[0], q_block=q_block, num_items=num_items,
                        sliding_window=sliding_window, block_tokens=blk)
    # One spare block of null pages: the loop reads the page ids one block ahead.
    tables = jnp.pad(page_indices,
                     ((0, 0), (0, (num_blocks + 1) * pages_per_block - pages_per_seq)))

    # Queries as [T + q_block, Hkv, Gp, D]: the tail lets the last item's tile load in range.
    qs = (q * sm_scale).astype(q.dtype).reshape(T, Hkv, G, D)
    qs = jnp.pad(qs, ((0, q_block), (0, 0), (0, Gp - G), (0, 0)))
    Tp = T + q_block

    meta = (items.seq, items.start, items.rows, items.first_pos, items.blk_lo, items.blk_hi)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h, k: (0,) * len(shape))
    head_q = pl.BlockSpec((Tp, None, Gp, D), lambda i, h, k: (0, h, 0, 0))
    with_lse = num_splits > 1 or sinks is not None
    if not with_lse:
        out_specs = head_q
        out_shape = jax.ShapeDtypeStruct((Tp, Hkv, Gp, D), q.dtype)
    else:  # per split: normalized f32 partial outputs and their log-sum-exp
        out_specs = [pl.BlockSpec((None, Tp, None, Gp, D), lambda i, h, k: (k, 0, h, 0, 0)),
                     pl.BlockSpec((None, Tp, None, Gp), lambda i, h, k: (k, 0, h, 0))]
        out_shape = [jax.ShapeDtypeStruct((num_splits, Tp, Hkv, Gp, D), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, Tp, Hkv, Gp), jnp.float32)]
    kernel = functools.partial(
        _kernel, q_block=q_block, group=Gp, pages_per_block=pages_per_block,
        num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    out = pl.pallas_call(
        kernel,
        grid=(num_items, Hkv, num_splits),
        in_specs=[whole((num_items,))] * len(meta) + [
            whole(tables.shape), head_q,
            pl.BlockSpec((P, ps, None, D), lambda i, h, k: (0, 0, 2 * h, 0)),
            pl.BlockSpec((P, ps, None, D), lambda i, h, k: (0, 0, 2 * h + 1, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*meta, tables, qs, kv_cache, kv_cache)
    if with_lse:
        parts, lse = out
        top = jnp.max(lse, axis=0)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        w = jnp.exp(lse - top)
        total = jnp.maximum(w.sum(0), 1e-30)
        out = jnp.sum(w[..., None] * parts, axis=0) / total[..., None]
        if sinks is not None:
            sink = jnp.pad(sinks.astype(jnp.float32).reshape(Hkv, G), ((0, 0), (0, Gp - G)))
            out = out * jax.nn.sigmoid(top + jnp.log(total) - sink)[..., None]
    out = out[:T, :, :G].reshape(T, Hq, D)
    live = jnp.arange(T) < cu_q_lens[num_seqs[0]]
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)

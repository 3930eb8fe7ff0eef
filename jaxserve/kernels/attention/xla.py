"""The tuned XLA path of ragged paged attention: pure JAX, the CPU serving path's prefill (and its
decodes where the CPU kernels are off), and the query-item helpers the Pallas kernels share. Every
path, this one included, is tested against the float64 reference (reference.py).

Cost follows the tokens actually attended. The flat query axis is cut into *items*: blocks of up to
`q_block` consecutive queries of one sequence. Items are processed `items_per_step` at a time in a
while loop whose trip count is the number of live items, and each group walks only the KV blocks
its own queries can see (causal upper bound, sliding-window lower bound), gathering those pages of
its own sequences from the cache. Padding sequences produce no items and so cost nothing.

Decodes (q_len 1) take their own path (`_decode`): one query per sequence, sequences grouped
instead of query blocks, so no query row is computed in vain; prefill chunks take query blocks so
a chunk's queries share each KV gather. Short queries (speculative verify rows: a decode and its
drafts) take query blocks of SHORT_QUERY_TOKENS over the decode path's KV blocks, so they do not
pay for a prefill block's padding. A mixed batch runs every path, each over its own sequences.
Items (and decoded sequences) are taken longest first, so the members of one group need about the
same number of KV blocks; the items left over after the full groups go one at a time.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.shapes import cdiv

# Picked by timing on the 2-core CPU (SmolLM2 shape, f32): KV positions per inner step and items
# per step for each path. Decode walks 64-token KV blocks: a block is gathered whole, and with 256
# a 100-token sequence gathered 2.5x the bytes it reads; 4 sequences per step beat 2, 8 and 16, and
# 32-token blocks lost. Prefill: 32-query items, 4 at a time over 128-token KV blocks, beat 2 over
# 256 on every mix tried, as less of each block is masked off by causality; 64- and 128-query
# items won on some mixes and lost on others. Measured: benchmarks/RESULTS.md, "The XLA path's
# block sizes, group sizes and item order".
DECODE_KV_BLOCK_TOKENS = 64
DECODE_SEQS_PER_STEP = 4
PREFILL_KV_BLOCK_TOKENS = 128
PREFILL_Q_BLOCK = 32
PREFILL_ITEMS_PER_STEP = 4
# Sequences of 2-8 queries (a decode verifying up to 7 drafts) take 8-query items, 4 at a time,
# over 64-token KV blocks, so they do not pay for a prefill item's padding. Each query row on the
# decode path instead (its pages gathered per row) won for one sequence but lost for many.
# Measured: benchmarks/RESULTS.md, "Short queries and leftover items".
SHORT_QUERY_TOKENS = 8

_MASKED = -1e30


def kv_rows(kv_cache, k, v, slot_mapping):
    """This step's K/V as cache rows [T, 2 * Hkv, D] (K head h at slot 2h, V head h at 2h + 1),
    checked against the cache and the slot mapping."""
    _, _, H2, D = kv_cache.shape
    T = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (H2 // 2, D) or slot_mapping.shape != (T,):
        raise ValueError(f"write_kv: k {k.shape}, v {v.shape}, slot_mapping {slot_mapping.shape} "
                         f"do not fit a cache of shape {kv_cache.shape} "
                         f"(k/v must be [T, {H2 // 2}, {D}])")
    return jnp.stack([k, v], axis=2).reshape(T, H2, D)


def write_kv(kv_cache, k, v, slot_mapping):
    """Scatter new K/V rows into the cache at `slot_mapping` (page * page_size + offset); slots
    outside the cache are dropped. The reshapes are bitcasts, so with the cache donated (or a loop
    carry) XLA updates it in place.
    """
    P, ps, H2, D = kv_cache.shape
    kv = kv_rows(kv_cache, k, v, slot_mapping).astype(kv_cache.dtype)
    flat = kv_cache.reshape(P * ps, H2, D).at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(P, ps, H2, D)


class QueryItems(NamedTuple):
    """Blocks of up to q_block consecutive queries of one sequence, live ones first."""
    seq: jax.Array  # i32[W] sequence of each item
    start: jax.Array  # i32[W] flat row of the item's first query
    rows: jax.Array  # i32[W] valid queries (0 for items past the live ones)
    first_pos: jax.Array  # i32[W] cache position of the item's first query
    blk_lo: jax.Array  # i32[W] first KV block (of block_tokens) any of its queries sees
    blk_hi: jax.Array  # i32[W] one past the last such block (== blk_lo when rows == 0)
    num_live: jax.Array  # i32[] number of live items


def query_items(cu_q_lens, kv_lens, num_seqs, *, q_block, num_items, sliding_window,
                block_tokens, include=None) -> QueryItems:
    """Cut the ragged query axis into items; also which KV blocks each item's queries can see.
    `include` (bool[S]) restricts the items to some sequences; the others get none."""
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_lens = jnp.where(jnp.arange(S) < num_seqs, q_lens, 0)
    covered = q_lens if include is None else jnp.where(include, q_lens, 0)
    blocks = (covered + q_block - 1) // q_block
    ends = jnp.cumsum(blocks)
    w = jnp.arange(num_items)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), S - 1).astype(jnp.int32)
    start = cu_q_lens[seq] + (w - (ends[seq] - blocks[seq])) * q_block
    rows = jnp.clip(cu_q_lens[seq + 1] - start, 0, q_block)
    rows = jnp.where(w < ends[-1], rows, 0)
    start = jnp.where(rows > 0, start, 0)
    first_pos = kv_lens[seq] - q_lens[seq] + (start - cu_q_lens[seq])
    # Causal: the last query sees up to its own position; a window bounds the first query's reach.
    hi = (first_pos + rows + block_tokens - 1) // block_tokens
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    lo = lo // block_tokens + jnp.zeros_like(hi)
    blk_hi = jnp.where(rows > 0, hi, 0)
    blk_lo = jnp.where(rows > 0, lo, 0)
    return QueryItems(seq, start.astype(jnp.int32), rows.astype(jnp.int32),
                      first_pos.astype(jnp.int32), blk_lo.astype(jnp.int32),
                      blk_hi.astype(jnp.int32), ends[-1])


def _kv_blocks(page_indices, page_size: int, kv_block_tokens: int):
    """(page table padded so every block's slice is in range, pages per block, tokens per block,
    number of blocks). Padded entries are masked by kv_len."""
    pages_per_seq = page_indices.shape[1]
    pages_per_block = max(1, kv_block_tokens // page_size)
    num_blocks = cdiv(pages_per_seq, pages_per_block)
    page_indices = jnp.pad(page_indices,
                           ((0, 0), (0, num_blocks * pages_per_block - pages_per_seq)))
    return page_indices, pages_per_block, pages_per_block * page_size, num_blocks


def _kv_block(kv_cache, tables, b, pages_per_block: int, gather_pages=None):
    """KV block b of each row's page table [I, pages]: K and V [I, tokens, Hkv, D] in f32, and
    the block's cache positions [tokens]. gather_pages(kv_cache, pages [I, n]) -> f32 [I, n,
    page_size, 2 * Hkv, D] replaces XLA's gather (see ragged_paged_attention)."""
    _, ps, H2, D = kv_cache.shape
    pages = lax.dynamic_slice_in_dim(tables, b * pages_per_block, pages_per_block, axis=1)
    kv = kv_cache[pages] if gather_pages is None else gather_pages(kv_cache, pages)
    kv = kv.reshape(tables.shape[0], pages_per_block * ps, H2 // 2, 2, D).astype(jnp.float32)
    return kv[..., 0, :], kv[..., 1, :], b * pages_per_block * ps + jnp.arange(pages_per_block * ps)


def _visible(k_pos, q_pos, sliding_window):
    """Which cache positions k_pos [K] each query at positions q_pos [...] sees: [..., K]."""
    mask = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[..., None] - sliding_window
    return mask


def _softmax_init(shape, head_dim: int):
    """Online-softmax state for queries of `shape`: running max, sum, and weighted values."""
    return (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _softmax_step(carry, s, mask, v, pv_spec: str, soft_cap):
    """Fold one KV block into the online softmax: scores s [..., K] under mask, values v
    combined with the probabilities by the einsum pv_spec."""
    m, l, acc = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = alpha[..., None] * acc + jnp.einsum(pv_spec, p, v, precision=lax.Precision.HIGHEST)
    return m_new, alpha * l + p.sum(-1), acc


def _softmax_out(carry, sink=None):
    """The attention output of the online softmax's final state. `sink` (broadcast to the
    running max's shape): gpt-oss's attention sinks, a learned logit per head that joins the
    denominator and carries no value."""
    m, l, acc = carry
    if sink is not None:
        top = jnp.maximum(m, sink)
        scale = jnp.exp(m - top)
        l = l * scale + jnp.exp(sink - top)
        acc = acc * scale[..., None]
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _head_sinks(sinks, Hkv: int):
    """sinks [Hq] as [Hkv, G] (the query layout's head axes), in f32."""
    return sinks.astype(jnp.float32).reshape(Hkv, -1)


def _attend(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
            soft_cap, q_block, items_per_step, kv_block_tokens, include=None, one_item_each=False,
            gather_pages=None, sinks=None):
    """Query blocks of q_block rows (`query_items`), items_per_step at a time. one_item_each:
    every included sequence has at most q_block queries, so there are at most S items."""
    T, Hq, D = q.shape
    _, ps, H2, _ = kv_cache.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    S = page_indices.shape[0]
    page_indices, pages_per_block, blk_tokens, num_blocks = _kv_blocks(page_indices, ps,
                                                                      kv_block_tokens)

    num_items = S if one_item_each else cdiv(T, q_block) + S
    num_items = cdiv(num_items, items_per_step) * items_per_step
    items = query_items(cu_q_lens, kv_lens, num_seqs[0], q_block=q_block, num_items=num_items,
                        sliding_window=sliding_window, block_tokens=blk_tokens, include=include)
    # Longest first: a group walks as many KV blocks as its longest item and gathers every item's
    # pages at each, so items of like length share a group and fewer unread blocks are gathered
    # (measured: benchmarks/RESULTS.md, "The XLA path's block sizes, group sizes and item order").
    # Items without rows have blk_hi 0 and stay last.
    order = jnp.argsort(-items.blk_hi, stable=True)
    items = items._replace(**{f: getattr(items, f)[order] for f in QueryItems._fields
                              if f != "num_live"})
    seq, first_pos = items.seq, items.first_pos
    r = jnp.arange(q_block)
    row_ids = items.start[:, None] + r[None, :]  # [W, q_block] flat query rows
    row_ok = r[None, :] < items.rows[:, None]
    row_ids = jnp.where(row_ok, row_ids, T)  # out of range: gathers clamp, scatters drop
    # Items without rows must not widen a group's KV range: lo past every block, hi 0.
    blk_lo = jnp.where(items.rows > 0, items.blk_lo, num_blocks)
    blk_hi = items.blk_hi

    qf = (q.astype(jnp.float32) * sm_scale).reshape(T, Hkv, G, D)

    def groups_of(width, first):
        """The loop body for groups of `width` items, the first group starting at item `first`."""

        def group(g, out):
            sl = lambda x: lax.dynamic_slice_in_dim(x, first + g * width, width)
            g_seq, g_rows, g_first = sl(seq), sl(row_ids), sl(first_pos)
            g_ok = sl(row_ok)
            # Head-major [I, Hkv, Qb, G, D], once per group: the contractions below are then
            # batched over (item, KV head) with the query rows contiguous, which XLA:CPU runs
            # without transposing them at every KV step.
            qg = jnp.take(qf, g_rows, axis=0, mode="clip").transpose(0, 2, 1, 3, 4)
            q_pos = g_first[:, None] + r[None, :]  # [I, Qb]
            tables = page_indices[g_seq]  # [I, pages]
            b0, b1 = jnp.min(sl(blk_lo)), jnp.max(sl(blk_hi))

            def kv_step(b, carry):
                k, v, k_pos = _kv_block(kv_cache, tables, b, pages_per_block, gather_pages)
                s = jnp.einsum("ihqgd,ikhd->ihqgk", qg, k, precision=lax.Precision.HIGHEST)
                mask = _visible(k_pos, q_pos, sliding_window)
                return _softmax_step(carry, s, mask[:, None, :, None, :], v,
                                     "ihqgk,ikhd->ihqgd", soft_cap)

            init = _softmax_init((width, Hkv, q_block, G), D)
            sink = None if sinks is None else _head_sinks(sinks, Hkv)[None, :, None, :]
            o = _softmax_out(lax.fori_loop(b0, b1, kv_step, init), sink).transpose(0, 2, 1, 3, 4)
            o = jnp.where(g_ok[:, :, None, None, None], o, 0.0).reshape(-1, Hq, D)
            return out.at[g_rows.reshape(-1)].set(o.astype(out.dtype), mode="drop")

        return group

    return _in_groups(items.num_live, items_per_step, groups_of, jnp.zeros((T, Hq, D), q.dtype))


def _in_groups(num_live, per_step: int, groups_of, out):
    """Run the live items (sorted first) through groups_of(width, first)'s loop body: full groups
    of per_step, then what is left one at a time. A last group padded with dead items would gather
    their (null) pages at every KV block all the same; full groups of per_step still beat going
    one at a time (measured: benchmarks/RESULTS.md, "Short queries and leftover items")."""
    full = num_live // per_step
    out = lax.fori_loop(0, full, groups_of(per_step, 0), out)
    return lax.fori_loop(0, num_live - full * per_step, groups_of(1, full * per_step), out)


def _decode(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
            soft_cap, include=None, gather_pages=None, sinks=None):
    """Sequences of one query (decodes), DECODE_SEQS_PER_STEP at a time, longest first, each group
    walking its own KV blocks. Written for XLA:CPU: one query per sequence means no query-block
    axis, so the two contractions are batched matrix products over (sequence, KV head) that XLA
    runs without the transposes the general path's layout needs (measured: benchmarks/RESULTS.md,
    "Reference attention rewritten for XLA:CPU")."""
    T, Hq, D = q.shape
    _, ps, H2, _ = kv_cache.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    S = page_indices.shape[0]
    per_step = min(DECODE_SEQS_PER_STEP, S)
    page_indices, pages_per_block, blk_tokens, num_blocks = _kv_blocks(page_indices, ps,
                                                                      DECODE_KV_BLOCK_TOKENS)
    live = (jnp.arange(S) < num_seqs[0]) & (cu_q_lens[1:] - cu_q_lens[:-1] == 1)
    if include is not None:
        live &= include
    # The query sits at kv_len - 1; it sees the blocks up to its own and, with a window, from the
    # block of its first visible position. Dead sequences get an empty range.
    blk_hi = jnp.where(live, (kv_lens + blk_tokens - 1) // blk_tokens, 0)
    first = 0 if sliding_window is None else jnp.maximum(kv_lens - sliding_window, 0)
    blk_lo = jnp.where(live, first // blk_tokens, num_blocks)
    width = cdiv(S, per_step) * per_step
    order = jnp.pad(jnp.argsort(-blk_hi, stable=True), (0, width - S), constant_values=S)
    seq_lo = jnp.take(blk_lo, order, mode="fill", fill_value=num_blocks)
    seq_hi = jnp.take(blk_hi, order, mode="fill", fill_value=0)
    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D) * sm_scale

    def groups_of(width, first):
        def group(g, out):
            sl = lambda x: lax.dynamic_slice_in_dim(x, first + g * width, width)
            seqs, g_lo, g_hi = sl(order), sl(seq_lo), sl(seq_hi)
            ok = g_hi > 0
            rows = jnp.where(ok, jnp.take(cu_q_lens, seqs, mode="clip"), T)  # T: scatter drops
            qg = jnp.take(qf, rows, axis=0, mode="clip")  # [I, Hkv, G, D]
            tables = jnp.take(page_indices, seqs, axis=0, mode="clip")
            q_pos = jnp.take(kv_lens, seqs, mode="clip") - 1

            def kv_step(b, carry):
                k, v, k_pos = _kv_block(kv_cache, tables, b, pages_per_block, gather_pages)
                s = jnp.einsum("ihgd,ikhd->ihgk", qg, k, precision=lax.Precision.HIGHEST)
                mask = _visible(k_pos, q_pos, sliding_window)
                return _softmax_step(carry, s, mask[:, None, None, :], v, "ihgk,ikhd->ihgd",
                                     soft_cap)

            init = _softmax_init((width, Hkv, G), D)
            sink = None if sinks is None else _head_sinks(sinks, Hkv)[None]
            o = _softmax_out(lax.fori_loop(jnp.min(g_lo), jnp.max(g_hi), kv_step, init),
                             sink).reshape(width, Hq, D)
            return out.at[rows].set(o.astype(out.dtype), mode="drop")

        return group

    return _in_groups(jnp.sum(live), per_step, groups_of, jnp.zeros((T, Hq, D), q.dtype))


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None, short_impl=None,
                           gather_pages=None):
    """Attention of ragged queries over a paged KV cache (contract: the package docstring).

    Rows past cu_q_lens[num_seqs] come back as zeros. `short_impl` replaces the decode and
    short-query paths: `_decode`'s signature and contract, for every sequence of up to
    SHORT_QUERY_TOKENS queries (the CPU kernel, see cpu.py). `gather_pages` replaces the gather
    of cache pages (`_kv_block`; cpu.py's for a bf16 cache, which XLA:CPU would widen whole).
    `sinks` [Hq] (gpt-oss): a learned logit per head in each softmax's denominator; `short_impl`
    takes none, so with sinks the XLA path's own decode runs.
    """
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if sinks is not None:
        short_impl, kwargs["sinks"] = None, sinks
    short = functools.partial(short_impl or functools.partial(_decode, gather_pages=gather_pages),
                              *args, **kwargs)
    kwargs["gather_pages"] = gather_pages
    if q.shape[0] == 1:
        return short()
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    chunk = q_lens > SHORT_QUERY_TOKENS

    def short_queries():
        # short_impl takes them all; else decodes on the decode path and short queries on query
        # blocks of their size: as a prefill item a decode computes a whole q_block of rows for
        # its one query (measured: benchmarks/RESULTS.md, "The XLA path's block sizes, group sizes
        # and item order"). Each path writes only its own rows and leaves the others 0, so the
        # sum is the whole answer.
        if short_impl is not None:
            return short(include=~chunk)
        return short(include=q_lens <= 1) + _attend(
            *args, **kwargs, q_block=SHORT_QUERY_TOKENS, items_per_step=DECODE_SEQS_PER_STEP,
            kv_block_tokens=DECODE_KV_BLOCK_TOKENS, include=(q_lens > 1) & ~chunk,
            one_item_each=True)

    def mixed():
        return short_queries() + _attend(
            *args, **kwargs, q_block=PREFILL_Q_BLOCK, items_per_step=PREFILL_ITEMS_PER_STEP,
            kv_block_tokens=PREFILL_KV_BLOCK_TOKENS, include=chunk)

    # A batch that one path covers runs only that one: decodes alone, or with short_impl every
    # batch without a chunk.
    alone = SHORT_QUERY_TOKENS if short_impl is not None else 1
    return lax.cond(jnp.max(q_lens) <= alone, short, mixed)

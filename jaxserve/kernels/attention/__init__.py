"""Ragged paged attention over one paged KV cache, and the KV write that fills it.

Contract (same layout as jax.experimental.pallas.ops.tpu.ragged_paged_attention):
    q             [T, Hq, D]   flat queries; rows past cu_q_lens[num_seqs] are padding
    kv_cache      [num_pages, page_size, 2 * Hkv, D]   K head h at slot 2h, V head h at 2h + 1
    kv_lens       i32[S]       tokens in the cache per sequence, including this step's new ones
    page_indices  i32[S, pages_per_seq]
    cu_q_lens     i32[S + 1]
    num_seqs      i32[1]
Query i of sequence s sits at position kv_lens[s] - q_len(s) + i and attends to cache positions
<= that (and > that - sliding_window when a window is set). GQA: Hq // Hkv queries per KV head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention import reference
from jaxserve.kernels.attention.validate import validate_inputs

IMPLS = ("reference", "cpu", "pallas_tpu", "pallas_gpu")


def _auto_impl() -> str:
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "cpu"}.get(jax.default_backend(),
                                                                         "reference")


def write_kv(kv_cache, k, v, slot_mapping, *, impl="auto"):
    """Scatter this step's K/V into the cache at `slot_mapping` (reference.write_kv). On the cpu
    path a bf16 cache is written by the CPU kernel library: XLA:CPU would widen the whole cache to
    f32 around its scatter."""
    if impl == "auto":
        impl = _auto_impl()
    if impl == "cpu" and kv_cache.dtype == jnp.bfloat16:
        from jaxserve.kernels.attention import cpu
        if cpu.available():
            return cpu.write_kv(kv_cache, k, v, slot_mapping)
    return reference.write_kv(kv_cache, k, v, slot_mapping)


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, impl="auto", interpret=False):
    """Dispatch to an implementation; impl="auto" picks by backend (CPU -> cpu: the reference
    with decodes and verifies through a C++ kernel where it builds and takes the shapes)."""
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "auto":
        impl = _auto_impl()
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "reference":
        return reference.ragged_paged_attention(*args, **kwargs)
    if impl == "cpu":
        from jaxserve.kernels.attention import cpu
        return cpu.ragged_paged_attention(*args, **kwargs)
    if impl == "pallas_tpu":
        from jaxserve.kernels.attention import tpu
        return tpu.ragged_paged_attention(*args, **kwargs, interpret=interpret)
    if impl == "pallas_gpu":
        from jaxserve.kernels.attention import gpu
        return gpu.ragged_paged_attention(*args, **kwargs, interpret=interpret)
    raise ValueError(f"impl={impl!r}: expected 'auto' or one of {IMPLS}")


__all__ = ["ragged_paged_attention", "write_kv", "validate_inputs", "IMPLS"]

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
`sinks` [Hq] (gpt-oss): a learned logit per query head that joins each softmax's denominator and
carries no value. Every path takes it (the CPU path runs its decodes on the XLA path then: its
C++ kernel has none).

Implementations: reference.py (float64 numpy, what every other one is tested against), xla.py
(the tuned pure-JAX path), cpu.py (xla.py with decodes and verifies through the C++ CPU kernel),
gpu.py and tpu.py (Pallas); validate.py's shape checks run before any of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.attention import xla
from jaxserve.kernels.attention.validate import validate_inputs

# The implementations; each is tested against the float64 reference (reference.py), which is not
# one of them: it is numpy, for tests and checks, never a serving path.
IMPLS = ("xla", "cpu", "pallas_tpu", "pallas_gpu")


def auto_impl() -> str:
    """What impl="auto" runs here: the Pallas kernel of the backend, the CPU path where the CPU
    kernels are enabled (jaxserve.kernels.cpu), else the tuned XLA path."""
    backend = jax.default_backend()
    if backend in ("tpu", "gpu"):
        return f"pallas_{backend}"
    return "cpu" if backend == "cpu" and cpu_kernels.enabled() else "xla"


def write_kv(kv_cache, k, v, slot_mapping, *, impl="auto"):
    """Scatter this step's K/V into the cache at `slot_mapping` (xla.write_kv). On the cpu
    path the CPU kernel library writes the rows in place: XLA:CPU would widen a whole bf16 cache
    to f32 around its scatter, and an f32 cache's scatter is 29 more thunks a layer than the call
    (a guarded dynamic-update-slice, a copy of the cache's buffer): ~9% of a batch-1 GGUF decode
    step (benchmarks/decode_step_profile.py)."""
    if impl == "auto":
        impl = auto_impl()
    if (impl == "cpu" and kv_cache.dtype in (jnp.bfloat16, jnp.float32)
            and cpu_kernels.enabled()):
        from jaxserve.kernels.attention import cpu
        return cpu.write_kv(kv_cache, k, v, slot_mapping)
    return xla.write_kv(kv_cache, k, v, slot_mapping)


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None, impl="auto",
                           interpret=False):
    """Dispatch to an implementation; impl="auto" picks by backend (`auto_impl`)."""
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if impl == "auto":
        impl = auto_impl()
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    args = (q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "xla":
        return xla.ragged_paged_attention(*args, **kwargs, sinks=sinks)
    if impl == "cpu":
        from jaxserve.kernels.attention import cpu
        return cpu.ragged_paged_attention(*args, **kwargs, sinks=sinks)
    if impl == "pallas_tpu":
        from jaxserve.kernels.attention import tpu
        return tpu.ragged_paged_attention(*args, **kwargs, sinks=sinks, interpret=interpret)
    if impl == "pallas_gpu":
        from jaxserve.kernels.attention import gpu
        return gpu.ragged_paged_attention(*args, **kwargs, sinks=sinks, interpret=interpret)
    raise ValueError(f"impl={impl!r}: expected 'auto' or one of {IMPLS}")


__all__ = ["ragged_paged_attention", "write_kv", "validate_inputs", "auto_impl", "IMPLS"]

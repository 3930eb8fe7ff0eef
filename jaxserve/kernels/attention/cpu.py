"""The CPU path: decodes and short queries through a C++ XLA FFI kernel (cpu/attention.cc),
prefill chunks through the tuned XLA path (xla.py).

A decode step is most of a CPU serving run, and the XLA path's decode spends more time in XLA
ops around the arithmetic than in it: each block of pages is gathered into a fresh buffer,
transposed for the batched dots and folded into the online softmax by a while loop of small ops.
The kernel reads each sequence's pages in place, one (sequence, KV head) per work item on XLA's
intra-op thread pool. Speculative verifies (a decode and its drafts, up to
xla.SHORT_QUERY_TOKENS queries) go the same way, each query with its own causal bound; their
pages are read once for all their queries. Prefill chunks stay on the XLA path, whose batched
query blocks suit them.

The kernel is part of the CPU kernels' library (jaxserve.kernels.cpu.library: built with the
host's compiler, cached, registered). Where the CPU kernels are off (`jaxserve.kernels.cpu.enabled`
False: the switch, no compiler, not on the CPU), everything takes the XLA path; so do bf16
queries and shapes the kernel does not take (`supports`).

A bf16 cache (`kv_cache_dtype="bfloat16"`) is read as f32, as the XLA path reads it, at half the
bytes. Its KV write and the prefill path's page gather go through the same library
(`write_kv`, `gather_pages`): XLA:CPU has no bf16 scatter or gather and widens the operand to f32
around one, which for the cache is the whole cache, twice per layer (measured:
benchmarks/RESULTS.md, "bf16 KV cache on the CPU path").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.attention import xla

# This path's targets in the library (attention.cc's handlers): the decode, the KV write, the
# gather.
_TARGET, _WRITE_KV, _GATHER_PAGES = TARGETS = (
    "jaxserve_paged_decode", "jaxserve_write_kv", "jaxserve_gather_pages")
# What the kernel takes (attention.cc checks the same): beyond these the XLA path runs.
HEAD_DIMS = (64, 128)
MAX_PAGE_SIZE = 64
MAX_QUERIES_PER_KV_HEAD = 8
# The most queries per sequence the kernel takes (attention.cc's kMaxQueries). The XLA path hands
# it every sequence of up to SHORT_QUERY_TOKENS queries; `supports` keeps it off a longer bound.
MAX_QUERIES_PER_SEQUENCE = 8


def supports(q, kv_cache) -> bool:
    """Whether the kernel takes these shapes and dtypes (f32 queries, an f32 or bf16 cache)."""
    _, Hq, D = q.shape
    _, page_size, H2, _ = kv_cache.shape
    return (q.dtype == jnp.float32 and kv_cache.dtype in (jnp.float32, jnp.bfloat16)
            and D in HEAD_DIMS and page_size <= MAX_PAGE_SIZE and Hq % (H2 // 2) == 0
            and Hq // (H2 // 2) <= MAX_QUERIES_PER_KV_HEAD
            and xla.SHORT_QUERY_TOKENS <= MAX_QUERIES_PER_SEQUENCE)


def short_queries(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                  sliding_window=None, soft_cap=None, include=None):
    """The rows of sequences with 1 to xla.SHORT_QUERY_TOKENS queries (and `include`d, when
    given); every other row 0. The XLA path's `short_impl` contract."""
    S = page_indices.shape[0]
    include = jnp.ones((S,), jnp.int32) if include is None else include.astype(jnp.int32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, include,
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0),
                max_queries=np.int64(xla.SHORT_QUERY_TOKENS))


def gather_pages(kv_cache, pages):
    """The cache's pages `pages` [...] widened to f32: [..., page_size, 2 * Hkv, D]; indices are
    clamped into the cache as XLA's gather clamps them. The XLA path's `gather_pages` hook."""
    shape = (*pages.shape, *kv_cache.shape[1:])
    call = jax.ffi.ffi_call(_GATHER_PAGES, jax.ShapeDtypeStruct(shape, jnp.float32))
    return call(kv_cache, pages.astype(jnp.int32))


def write_kv(kv_cache, k, v, slot_mapping):
    """xla.write_kv in place through the library (the output aliases the cache); for an f32 or
    bf16 cache, where the CPU kernels are enabled."""
    rows = xla.kv_rows(kv_cache, k, v, slot_mapping).astype(jnp.float32)
    call = jax.ffi.ffi_call(_WRITE_KV,
                            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
                            input_output_aliases={0: 0})
    return call(kv_cache, rows, slot_mapping.astype(jnp.int32))


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None):
    """The XLA path with its decode and short-query paths replaced by the kernel where the CPU
    kernels are enabled and it takes these shapes (`supports`), and a bf16 cache's page gathers by
    the library's whatever the shapes; else the XLA path alone. The kernel has no attention
    sinks (gpt-oss): with `sinks` the decodes take the XLA path too."""
    enabled = cpu_kernels.enabled()
    use_kernel = enabled and supports(q, kv_cache) and sinks is None
    library_gather = enabled and kv_cache.dtype == jnp.bfloat16
    return xla.ragged_paged_attention(
        q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
        short_impl=short_queries if use_kernel else None,
        gather_pages=gather_pages if library_gather else None)

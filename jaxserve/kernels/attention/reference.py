"""The reference: ragged paged attention in float64 numpy, written for clarity, not speed.

Every implementation (the tuned XLA path, the CPU kernel's path, the Pallas GPU and TPU kernels) is
tested against it, with the same signature as theirs (the contract: the package docstring). It
reads each sequence's pages, widens everything to float64 and takes a plain softmax over the
positions each query sees, so its answer carries no rounding of ours worth the name.
"""

from __future__ import annotations

import numpy as np

from jaxserve.kernels.attention.validate import validate_inputs
from jaxserve.shapes import cdiv


def ragged_paged_attention(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None) -> np.ndarray:
    """out float64[T, Hq, D]; rows past cu_q_lens[num_seqs] are zeros. Arrays may be numpy or
    JAX (a bf16 cache is read at its values)."""
    validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                    sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    q = np.asarray(q).astype(np.float64)
    cache = np.asarray(kv_cache).astype(np.float64)
    kv_lens, page_indices, cu_q_lens = map(np.asarray, (kv_lens, page_indices, cu_q_lens))
    T, Hq, D = q.shape
    _, page_size, H2, _ = cache.shape
    group = Hq // (H2 // 2)
    out = np.zeros((T, Hq, D))
    for s in range(int(np.asarray(num_seqs)[0])):
        q0, q1, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        pages = page_indices[s, :cdiv(kv_len, page_size)]
        kv = cache[pages].reshape(-1, H2, D)[:kv_len]
        # K head h at slot 2h, V at 2h + 1; each repeated for the query heads it serves.
        k = np.repeat(kv[:, 0::2], group, axis=1)
        v = np.repeat(kv[:, 1::2], group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q[q0:q1], k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        # Query i of the sequence sits at position kv_len - q_len + i.
        pos = kv_len - (q1 - q0) + np.arange(q1 - q0)
        keys = np.arange(kv_len)
        visible = keys[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - sliding_window
        scores = np.where(visible[None], scores, -np.inf)
        top = scores.max(-1, keepdims=True, initial=-np.inf)
        if sinks is not None:  # gpt-oss: a learned logit per head, in the denominator only
            sink = np.asarray(sinks).astype(np.float64)[:, None, None]
            top = np.maximum(top, sink)
        # A query that sees nothing (before position 0: outside the contract) answers zeros.
        weights = np.where(visible[None], np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
        total = weights.sum(-1, keepdims=True)
        if sinks is not None:
            total = total + np.exp(sink - top)
        probs = weights / np.where(total > 0, total, 1)
        out[q0:q1] = np.einsum("hqk,khd->qhd", probs, v)
    return out

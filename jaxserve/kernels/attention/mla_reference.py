"""The reference of latent attention over a paged latent cache: float64 numpy, for clarity.

The tuned path (mla.py) is tested against it, with the same signature. Contract:
    q             [T, H, L]    per head: the latent query (q_nope absorbed through kv_b_proj's
                               key part, kv_lora_rank wide) then the rope query; L = latent_dim
    latent_cache  [num_pages, page_size, L]   per token: the normed latent, then the rope key
    kv_lens, page_indices, cu_q_lens, num_seqs: as ragged paged attention's (the package
                               docstring of jaxserve.kernels.attention)
    -> out        [T, H, kv_lora_rank]   the softmax-weighted latents (kv_b_proj's value part
                               turns them into each head's value)
The score of a query and a cached token is q . row (the whole row: latent and rope key); the
value is the row's first kv_lora_rank entries. Causal within each sequence, every head over the
one shared latent (multi-query attention whose key is the row and whose value is its latent).
"""

from __future__ import annotations

import numpy as np

from jaxserve.kernels.attention.mla_validate import validate_mla_inputs
from jaxserve.shapes import cdiv


def mla_ragged_paged_attention(q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               kv_lora_rank: int, sm_scale: float) -> np.ndarray:
    """out float64[T, H, kv_lora_rank]; rows past cu_q_lens[num_seqs] are zeros."""
    validate_mla_inputs(q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs,
                        kv_lora_rank=kv_lora_rank)
    q = np.asarray(q).astype(np.float64)
    cache = np.asarray(latent_cache).astype(np.float64)
    kv_lens, page_indices, cu_q_lens = map(np.asarray, (kv_lens, page_indices, cu_q_lens))
    T, H, L = q.shape
    page_size = cache.shape[1]
    out = np.zeros((T, H, kv_lora_rank))
    for s in range(int(np.asarray(num_seqs)[0])):
        q0, q1, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        rows = cache[page_indices[s, :cdiv(kv_len, page_size)]].reshape(-1, L)[:kv_len]
        scores = np.einsum("qhl,kl->hqk", q[q0:q1], rows) * sm_scale
        pos = kv_len - (q1 - q0) + np.arange(q1 - q0)
        visible = np.arange(kv_len)[None, :] <= pos[:, None]
        scores = np.where(visible[None], scores, -np.inf)
        top = scores.max(-1, keepdims=True, initial=-np.inf)
        weights = np.where(visible[None], np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
        total = weights.sum(-1, keepdims=True)
        probs = weights / np.where(total > 0, total, 1)
        out[q0:q1] = np.einsum("hqk,kr->qhr", probs, rows[:, :kv_lora_rank])
    return out

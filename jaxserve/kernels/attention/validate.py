"""Static shape checks shared by every implementation, so a bad call fails with a message."""

from __future__ import annotations

import numpy as np


def validate_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                    sliding_window=None, soft_cap=None, sinks=None):
    if q.ndim != 3 or kv_cache.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and kv_cache [pages, page_size, 2*Hkv, D]; got "
                         f"q {q.shape}, kv_cache {kv_cache.shape}")
    T, Hq, D = q.shape
    P, ps, H2, Dk = kv_cache.shape
    if Dk != D:
        raise ValueError(f"head_dim differs: q has {D}, kv_cache has {Dk}")
    if H2 % 2:
        raise ValueError(f"kv_cache axis 2 holds K and V interleaved and must be even; got {H2}")
    if Hq % (H2 // 2):
        raise ValueError(f"{Hq} query heads are not a multiple of {H2 // 2} KV heads")
    validate_batch(kv_lens, page_indices, cu_q_lens, num_seqs, num_pages=P)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1; got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0; got {soft_cap}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks must be one logit per query head [{Hq}]; got {sinks.shape}")


def validate_batch(kv_lens, page_indices, cu_q_lens, num_seqs, *, num_pages: int) -> None:
    """The batch metadata's checks (shapes, integer dtypes, pages within a pool of num_pages),
    which every attention over a paged cache shares (latent attention's too: mla_validate.py)."""
    if page_indices.ndim != 2:
        raise ValueError(f"page_indices must be [S, pages_per_seq]; got {page_indices.shape}")
    S = page_indices.shape[0]
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,) or num_seqs.shape != (1,):
        raise ValueError(f"expected kv_lens [{S}], cu_q_lens [{S + 1}], num_seqs [1] for {S} "
                         f"sequences; got {kv_lens.shape}, {cu_q_lens.shape}, {num_seqs.shape}")
    for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name} must be integer; got {a.dtype}")
    if isinstance(page_indices, np.ndarray) and page_indices.size:
        lo, hi = int(page_indices.min()), int(page_indices.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(f"page_indices span [{lo}, {hi}] but the cache has {num_pages} pages")

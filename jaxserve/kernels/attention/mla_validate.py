"""Static shape checks of latent attention (mla.py, mla_reference.py), so a bad call fails with a
message rather than a wrong answer."""

from __future__ import annotations

import numpy as np


def validate_mla_inputs(q, latent_cache, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                        kv_lora_rank: int) -> None:
    if q.ndim != 3 or latent_cache.ndim != 3:
        raise ValueError(f"q must be [T, H, L] and latent_cache [pages, page_size, L]; got q "
                         f"{q.shape}, latent_cache {latent_cache.shape}")
    if q.shape[2] != latent_cache.shape[2]:
        raise ValueError(f"latent width differs: q has {q.shape[2]}, the cache "
                         f"{latent_cache.shape[2]}")
    if not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"kv_lora_rank must be in (0, {q.shape[2]}]; got {kv_lora_rank}")
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
        if lo < 0 or hi >= latent_cache.shape[0]:
            raise ValueError(f"page_indices span [{lo}, {hi}] but the cache has "
                             f"{latent_cache.shape[0]} pages")

"""Static shape checks of latent attention (mla.py, mla_reference.py), so a bad call fails with a
message rather than a wrong answer."""

from __future__ import annotations

from jaxserve.kernels.attention.validate import validate_batch


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
    validate_batch(kv_lens, page_indices, cu_q_lens, num_seqs, num_pages=latent_cache.shape[0])

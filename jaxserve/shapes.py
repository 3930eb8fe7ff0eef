"""Shape arithmetic every layer shares, from the scheduler's page counts to the kernels' grids.

No JAX: host-side bookkeeping reads it as well as the device code.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers (pages for tokens, blocks for rows)."""
    return -(-a // b)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                   num_layers: int = 1) -> tuple[int, int, int, int]:
    """The paged KV cache, all layers in one array: [num_layers * num_pages, page_size,
    2 * num_kv_heads, head_dim]. Layer l's page p is row l * num_pages + p; K of head h sits at
    slot 2h and its V at 2h + 1, so one page row holds both for every head (one DMA per page)."""
    return num_layers * num_pages, page_size, 2 * num_kv_heads, head_dim


def mla_cache_shape(num_pages: int, page_size: int, latent_dim: int,
                    num_layers: int = 1) -> tuple[int, int, int]:
    """The paged cache of latent attention (DeepSeek-V3), all layers in one array:
    [num_layers * num_pages, page_size, latent_dim], one row per token: its compressed latent
    then its rope key, shared by every head. Pages are counted as the standard layout's (layer
    l's page p is row l * num_pages + p); only the bytes of a page differ."""
    return num_layers * num_pages, page_size, latent_dim

"""A prompt's KV pages out of a prefill engine and into a decode engine (prefill/decode
disaggregation: jaxserve.disagg moves them between servers). Both run on the engine thread,
between steps (AsyncEngine.call), and use the prefix cache's host tier (--kv-offloading-size):
its copy programs read the pages, and its slots receive them.

What travels is the prompt's full pages that the prefill engine's prefix cache indexes, in order
(the pages `lookup_prefix` would hit: never the page holding the prompt's last token). The decode
engine keys them by its own chained hashes of the prompt's tokens under the request's cache salt,
so a page is only ever read behind the very prefix and tenant it was computed for, and puts them
in its host tier (those its LRU overwrites go to the disk tier, when there is one); the
request's admission then restores them as any host-tier hit
(KVCacheManager.restore_prefix) and computes only the rest of the prompt, which samples the first
token. That is vLLM's shape for its KV connectors (the decode side recomputes the prompt's last
token); the prefill's own first token is not sent, so sampling (seeds, penalties, logprobs) stays
in one place. A page the prefill engine evicted before the export, or that the decode engine's
host tier cannot keep, is computed on the decode side: slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import ml_dtypes  # noqa: F401 - names bfloat16 and the fp8 dtypes for numpy (a page's dtype)
import numpy as np

from jaxserve.core.cache import extend_page_hashes
from jaxserve.core.request import Request
from jaxserve.errors import ConfigError

if TYPE_CHECKING:
    from jaxserve.core.engine import LLMEngine


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on for a page to mean the same thing."""

    num_layers: int
    page_size: int
    page_shape: tuple[int, ...]  # one layer's page: [page_size, 2 * num_kv_heads, head_dim]
    dtype: str

    @property
    def page_bytes(self) -> int:
        """One page of every layer."""
        return self.num_layers * int(np.prod(self.page_shape)) * np.dtype(self.dtype).itemsize


def kv_layout(engine: LLMEngine) -> KVLayout:
    pool = engine.runner.host_pool
    if pool is None:
        raise ConfigError("--role prefill and --role decode need the host KV tier: give "
                          "--kv-offloading-size")
    return KVLayout(pool.num_layers, engine.config.cache.page_size,
                    tuple(pool.buffer.shape[2:]), str(pool.buffer.dtype))


def export_prefix(engine: LLMEngine, token_ids: Sequence[int],
                  cache_salt: str | None) -> np.ndarray:
    """The prompt's full pages its prefix cache holds, [layers, pages, *page], leading pages
    only (none when the first is gone)."""
    cache = engine.scheduler.cache
    pages = cache.lookup_prefix(Request("kv-export", list(token_ids), cache_salt=cache_salt))
    return engine.runner.read_pages(pages)


def import_prefix(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None,
                  pages: np.ndarray) -> int:
    """Put the prompt's first pages.shape[1] full pages (computed elsewhere) in the host tier,
    those not on the device already; returns how many were put. The caller checked the layout
    and that they are at most the prompt's full pages before its last token."""
    cache, page_size = engine.scheduler.cache, engine.config.cache.page_size
    num_pages = pages.shape[1]
    assert num_pages <= (len(token_ids) - 1) // page_size, "only pages lookup_prefix can hit"
    hashes = extend_page_hashes([], token_ids, page_size, num_pages, cache_salt)
    on_device = cache.count_cached_prefix(hashes)
    # A schedule that decided copies but scheduled nothing leaves them pending: they run now,
    # before any slot is taken (as they would before the next forward).
    engine.runner.copy_pages(cache.take_page_copies())
    put = 0
    # Tail first: when the tier has fewer slots than pages, the prefix's head is what stays.
    for i in reversed(range(on_device, num_pages)):
        tokens = tuple(token_ids[i * page_size:(i + 1) * page_size])
        slot = cache.host_tier.put(hashes[i], tokens)
        if slot is not None:
            # The page the slot held goes to the disk tier, if any: its bytes are copied out
            # before the slot is overwritten.
            engine.runner.copy_pages(cache.take_page_copies())
            engine.runner.host_pool.write_slot(slot, pages[:, i])
            put += 1
    return put

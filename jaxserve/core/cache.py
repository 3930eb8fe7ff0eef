"""Host-side page pool with refcounts and a prefix cache (plain Python, no JAX).

Every usable page is in exactly one of three states:
- free: never cached, or evicted; handed out first;
- cached-free: refcount 0 but still indexed by its content hash, so a later request with the same
  prefix can take it back without recomputing; evicted least-recently-freed first, and only when
  the free list is empty;
- in use: refcount >= 1, in the page table of that many live requests (shared prefix pages).
Page 0 is the null page (see jaxserve/executor/batch_plan.py): it is never handed out.

Prefix caching indexes FULL pages by a chained hash, hash(parent page's hash, this page's tokens),
so a page is only reused behind the very prefix it was computed with. The hash is a keyed digest
(blake2b) rather than Python's `hash` because prompts are user input and tuple hashes of ints can be
collided on purpose; the page's token ids are still compared on every hit.

Pins (Anthropic's `cache_control` breakpoints): a pin holds its own reference on the indexed full
pages of one prompt prefix until it expires, so they stay "in use" and the LRU cannot evict them;
a later request with the same prefix (same salt: pins are per tenant as the pages are) reads them
as any cached page. A pin is keyed by the chained hash of its last page (the salt and the whole
prefix): pinning the same prefix again renews it. Bounds: at most `max_pins_per_salt` pins per
salt (past it the salt's oldest pin is released: a tenant's newest prefixes win over its older
ones) and at most `pin_pool_fraction` of the usable pages pinned in all (past it the new pin is
not made: no tenant's pins can push out another's). Pinned pages are counted per pin (a page two
pins share counts twice: the bound errs on the safe side). Expired pins are released lazily, by
`expire_pins` (the scheduler calls it every step); no thread. Pins are a cache, not a
reservation: when a request cannot start with nothing running, the scheduler releases pins,
oldest first, until it can (`release_oldest_pin`), so pins never stall an idle engine.

Host tier (`host_tier`, jaxserve.core.kv_offload): an indexed page the LRU evicts is saved to host
memory, and `restore_prefix` (the scheduler calls it before looking a waiting request up) brings
back the pages of a prompt's prefix that follow those still on the device into free device pages,
indexed as cached pages, so admission takes them as any cached page and their prefill is skipped.
The pages for them come from the free list or the LRU, never from the prefix being restored.
With a disk tier below it (jaxserve.core.kv_disk) the host tier finds those pages there too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxserve.executor.batch_plan import NULL_PAGE, pages_for
from jaxserve.errors import ConfigError
from jaxserve.core.kv_offload import HostTier
from jaxserve.core.request import Request


def hash_page(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def extend_page_hashes(hashes: list[bytes], token_ids: Sequence[int], page_size: int,
                       num_full_pages: int, salt: str | None = None) -> list[bytes]:
    """Append the chained hashes of pages len(hashes)..num_full_pages-1 of token_ids. `salt`
    (vLLM's cache_salt: the tenant, or its sharing group) is the first page's parent, so
    requests with different salts never share a page, and one cannot learn another's prompt
    from how fast its own is served."""
    root = hashlib.blake2b(salt.encode(), digest_size=16).digest() if salt else None
    for i in range(len(hashes), num_full_pages):
        hashes.append(hash_page(hashes[-1] if hashes else root,
                                token_ids[i * page_size:(i + 1) * page_size]))
    return hashes


# Pin bounds (see the module docstring): a quarter of the pool at most stays pinned, so pins
# never starve the requests that run; 16 prefixes per tenant (Anthropic allows 4 per request).
PIN_POOL_FRACTION = 0.25
MAX_PINS_PER_SALT = 16


@dataclass
class _Pin:
    salt: str | None
    pages: list[int]
    expires: float  # the caller's clock (time.monotonic in the scheduler)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, *,
                 pin_pool_fraction: float = PIN_POOL_FRACTION,
                 max_pins_per_salt: int = MAX_PINS_PER_SALT, host_tier: HostTier | None = None):
        if num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        self._num_in_use = 0
        self._free: deque[int] = deque(range(1, num_pages))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_page: dict[bytes, int] = {}
        self._page_hash: dict[int, bytes] = {}
        self._page_tokens: dict[int, tuple[int, ...]] = {}
        self._holders: dict[str, Request] = {}  # requests holding pages, by id
        self._num_registered: dict[str, int] = {}  # leading pages of a holder already indexed
        self._pins: OrderedDict[bytes, _Pin] = OrderedDict()  # oldest made or renewed first
        self._num_pinned_pages = 0  # summed over pins
        self._next_expiry = float("inf")
        self.max_pinned_pages = int(pin_pool_fraction * self.num_usable_pages)
        self.max_pins_per_salt = max_pins_per_salt
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served from the cache (either tier)
        self.host_tier = host_tier if enable_prefix_caching else None
        self._restored: set[int] = set()  # pages restored from the host tier, not yet admitted
        self._from_disk: set[int] = set()  # of which read from its disk tier
        self.host_tier_queries = 0  # full prompt-page tokens past the device's own hits
        self.host_tier_hits = 0  # of which restored from the host tier (or its disk tier)
        self.disk_tier_hits = 0  # of which restored from the disk tier
        self.pins_expired = 0  # pins released at their TTL, total since start

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_pinned_pages(self) -> int:
        return self._num_pinned_pages

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def num_cached_free_pages(self) -> int:
        return len(self._cached_free)

    @property
    def num_pages_in_use(self) -> int:
        return self._num_in_use

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    # ---- prefix cache ------------------------------------------------------------------------

    def _hashes(self, request: Request, num_full_pages: int) -> list[bytes]:
        hashes = request.page_hashes
        if len(hashes) < num_full_pages:
            extend_page_hashes(hashes, request.all_token_ids, self.page_size, num_full_pages,
                               request.cache_salt)
        return hashes

    def lookup_prefix(self, request: Request) -> list[int]:
        """Cached pages holding the longest prefix of the request's tokens, in order.

        Never the whole sequence: its last token is always left to compute so the request can
        sample. No side effects; `admit` takes the pages.
        """
        if not self.enable_prefix_caching:
            return []
        max_pages = (request.num_tokens - 1) // self.page_size
        tokens = request.all_token_ids
        ps = self.page_size
        hits = []
        for i, h in enumerate(self._hashes(request, max_pages)[:max_pages]):
            page = self._hash_to_page.get(h)
            if page is None or self._page_tokens[page] != tuple(tokens[i * ps:(i + 1) * ps]):
                break
            hits.append(page)
        return hits

    def count_cached_prefix(self, page_hashes: Sequence[bytes]) -> int:
        """How many leading pages of a prompt (its chained page hashes) are indexed now.

        Safe from another thread: each test is one dict lookup, atomic in CPython, and the answer
        may be a step stale. A routing hint (jaxserve.core.replicas), never an
        admission decision."""
        n = 0
        while n < len(page_hashes) and page_hashes[n] in self._hash_to_page:
            n += 1
        return n

    def pages_in_flight(self, requests: Sequence[Request]) -> set[bytes]:
        """Hashes of the full pages these requests hold or will compute but have not indexed yet."""
        if not self.enable_prefix_caching:
            return set()
        out: set[bytes] = set()
        for r in requests:
            start = self._num_registered.get(r.request_id, 0)
            full = r.num_tokens // self.page_size
            out.update(self._hashes(r, full)[start:full])
        return out

    def next_page_in_flight(self, request: Request, cached_pages: Sequence[int],
                            in_flight: set[bytes]) -> bool:
        """Whether the first page the request would compute after its cached prefix is being
        computed by another request (same chained hash: same prefix), so waiting one step or a few
        turns it into a hit instead of computing it twice (n > 1 siblings, identical prompts)."""
        k = len(cached_pages)
        if not in_flight or k >= (request.num_tokens - 1) // self.page_size:
            return False
        return self._hashes(request, k + 1)[k] in in_flight

    def register_full_pages(self, request: Request) -> None:
        """Index the request's pages that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        num_full = request.num_computed_tokens // self.page_size
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        tokens = request.all_token_ids
        ps = self.page_size
        for i in range(start, num_full):
            page = request.page_table[i]
            # Two requests may compute the same prefix at once; the first one indexed wins and
            # the other's copy goes back to the free list when released.
            if hashes[i] not in self._hash_to_page:
                self._index(page, hashes[i], tuple(tokens[i * ps:(i + 1) * ps]))
        self._num_registered[request.request_id] = num_full

    def _index(self, page: int, page_hash: bytes, tokens: tuple[int, ...]) -> None:
        self._hash_to_page[page_hash] = page
        self._page_hash[page] = page_hash
        self._page_tokens[page] = tokens

    def restore_prefix(self, request: Request) -> int:
        """Bring back from the host tier the pages of the request's prefix that follow those on
        the device, into free device pages indexed as cached ones (admission then takes them
        like any cached page; `lookup_prefix` finds them). Returns the pages restored. Their
        copies run before the next step's forward (`take_page_copies`)."""
        if self.host_tier is None:
            return 0
        max_pages = (request.num_tokens - 1) // self.page_size
        hashes = self._hashes(request, max_pages)
        tokens, ps = request.all_token_ids, self.page_size
        held = []  # the prefix's device pages, taken so that the pops below cannot evict them
        wanted = []  # (hash, tokens) of the prefix's pages the host holds
        try:
            for i in range(max_pages):
                page_tokens = tuple(tokens[i * ps:(i + 1) * ps])
                page = self._hash_to_page.get(hashes[i])
                if page is not None and self._page_tokens[page] == page_tokens:
                    self._take(page)
                    held.append(page)
                elif (page is None and len(wanted) < self.num_free_pages  # no page, no read
                      and self.host_tier.find(hashes[i], page_tokens)):
                    wanted.append((hashes[i], page_tokens))
                else:
                    break
            wanted = wanted[:self.num_free_pages]
            # The pops below may save evicted pages: they must not overwrite these slots.
            self.host_tier.reserve([h for h, _ in wanted])
            for page_hash, page_tokens in wanted:
                page = self._pop_page()
                self._index(page, page_hash, page_tokens)
                if self.host_tier.restore(page_hash, page):
                    self._from_disk.add(page)
                self._restored.add(page)
                held.append(page)
        finally:
            self._release(held)
        self.host_tier.refresh([h for h, _ in reversed(wanted)])
        return len(wanted)

    def read_ahead(self, requests) -> None:
        """Have the disk tier read the files of these waiting requests' prefixes, past the pages
        the device and the host hold (`restore_prefix` then finds them read)."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        if disk is None:
            return
        wanted = []
        for request in requests:
            if not request.scores_prompt:
                wanted += self._disk_pages(request)
        disk.read_ahead(wanted)

    def _disk_pages(self, request: Request) -> list[tuple[bytes, tuple[int, ...]]]:
        """(hash, tokens) of the request's prefix pages that only the disk tier holds, up to the
        first page no tier holds."""
        max_pages = (request.num_tokens - 1) // self.page_size
        hashes = self._hashes(request, max_pages)
        tokens, ps = request.all_token_ids, self.page_size
        out = []
        for i in range(max_pages):
            page_tokens = tuple(tokens[i * ps:(i + 1) * ps])
            page = self._hash_to_page.get(hashes[i])
            if (page is not None and self._page_tokens[page] == page_tokens) \
                    or self.host_tier.holds(hashes[i], page_tokens):
                continue
            if not self.host_tier.disk.holds(hashes[i], page_tokens):
                break
            out.append((hashes[i], page_tokens))
        return out

    def take_page_copies(self):
        """The host tier's copies decided since the last call, in order (PageCopies runs)."""
        return self.host_tier.take_copies() if self.host_tier is not None else ()

    # ---- pins --------------------------------------------------------------------------------

    def pin(self, request: Request, num_tokens: int, ttl_s: float, now: float) -> int:
        """Pin the indexed full pages of the request's first `num_tokens` tokens until now + ttl_s.

        Returns the tokens the pin covers when it is new, 0 when it renewed a pin of the same
        prefix, covers no full page, or is over the pool bound (not made)."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self._hashes(request, num_tokens // self.page_size)[:num_tokens // self.page_size]
        pages = []
        for h in hashes:  # the prefix's pages as indexed (maybe another request's copies)
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        if not pages:
            return 0
        key = hashes[len(pages) - 1]
        expires = now + ttl_s
        old = self._pins.get(key)
        if old is not None:
            old.expires = max(old.expires, expires)
            self._pins.move_to_end(key)
            self._next_expiry = min(self._next_expiry, old.expires)
            return 0
        if self._num_pinned_pages + len(pages) > self.max_pinned_pages:
            return 0
        own = [k for k, p in self._pins.items() if p.salt == request.cache_salt]
        for k in own[:max(0, len(own) - self.max_pins_per_salt + 1)]:
            self._unpin(k)
        for page in pages:
            self._take(page)
        self._pins[key] = _Pin(request.cache_salt, pages, expires)
        self._num_pinned_pages += len(pages)
        self._next_expiry = min(self._next_expiry, expires)
        return len(pages) * self.page_size

    def expire_pins(self, now: float) -> None:
        """Release the pins whose time is up (cheap when none is due)."""
        if now < self._next_expiry:
            return
        for key in [k for k, p in self._pins.items() if p.expires <= now]:
            self._unpin(key)
            self.pins_expired += 1
        self._next_expiry = min((p.expires for p in self._pins.values()), default=float("inf"))

    def release_oldest_pin(self) -> bool:
        """Release the pin made or renewed longest ago; False when there is none."""
        if not self._pins:
            return False
        self._unpin(next(iter(self._pins)))
        return True

    def forget_contents(self) -> None:
        """The device pool was freed (a sleeping engine): release every pin and drop the prefix
        index, so every page is free and no lookup finds a page whose contents are gone. Only
        with no request holding a page."""
        if self._holders:
            raise ValueError(f"{len(self._holders)} requests still hold KV pages")
        while self.release_oldest_pin():
            pass
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._hash_to_page.clear()
        self._page_hash.clear()
        self._page_tokens.clear()
        self._restored.clear()
        self._from_disk.clear()
        if self.host_tier is not None:
            self.host_tier.drop_unrun_copies()

    def _unpin(self, key: bytes) -> None:
        pin = self._pins.pop(key)
        self._num_pinned_pages -= len(pin.pages)
        self._release(pin.pages)

    # ---- allocation --------------------------------------------------------------------------

    def num_allocatable_tokens(self, request: Request, cached_pages: Sequence[int] = ()) -> int:
        """New tokens the request could get pages for now (after taking `cached_pages`)."""
        taken_from_cached_free = sum(1 for p in cached_pages if p in self._cached_free)
        avail = self.num_free_pages - taken_from_cached_free
        computed = max(request.num_computed_tokens, len(cached_pages) * self.page_size)
        held = len(request.page_table) + len(cached_pages)
        return (held + avail) * self.page_size - computed

    def admit(self, request: Request, cached_pages: Sequence[int], num_new_tokens: int) -> bool:
        """Give a request with no pages its cached prefix pages plus pages for num_new_tokens.

        On success, `num_computed_tokens` counts the cached tokens. On failure nothing changes.
        """
        if request.page_table or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds pages")
        if num_new_tokens > self.num_allocatable_tokens(request, cached_pages):
            return False
        for page in cached_pages:
            self._take(page)
        request.page_table = list(cached_pages)
        request.num_computed_tokens = len(cached_pages) * self.page_size
        self._holders[request.request_id] = request
        self._num_registered[request.request_id] = len(cached_pages)
        self._grow(request, num_new_tokens)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += request.num_computed_tokens
        if self.host_tier is not None:
            restored = self._restored.intersection(cached_pages)
            self._restored -= restored
            self.disk_tier_hits += len(self._from_disk & restored) * self.page_size
            self._from_disk -= restored
            device_hits = len(cached_pages) - len(restored)
            self.host_tier_queries += ((request.num_tokens - 1) // self.page_size
                                       - device_hits) * self.page_size
            self.host_tier_hits += len(restored) * self.page_size
        return True

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Extend the page table to cover num_computed_tokens + num_new_tokens; False (and no
        change) when the pool cannot."""
        if num_new_tokens > self.num_allocatable_tokens(request):
            return False
        self._holders[request.request_id] = request
        self._grow(request, num_new_tokens)
        return True

    def free(self, request: Request) -> None:
        """Release every page the request holds and forget it (pages of a shared prefix stay with
        their other holders; indexed pages stay cached until evicted)."""
        self._release(request.page_table)
        request.page_table = []
        self._holders.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)

    def _release(self, pages: Sequence[int]) -> None:
        # Tail pages first, so LRU eviction drops the end of a prefix before its beginning (a page
        # is useless once its parent is gone).
        for page in reversed(pages):
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._num_in_use -= 1
                if page in self._page_hash:
                    self._cached_free[page] = None
                else:
                    self._free.append(page)

    def _grow(self, request: Request, num_new_tokens: int) -> None:
        total = self.pages_for(request.num_computed_tokens + num_new_tokens)
        for _ in range(total - len(request.page_table)):
            request.page_table.append(self._pop_page())

    def _take(self, page: int) -> None:
        if self._refcount[page] == 0:
            self._num_in_use += 1
            self._cached_free.pop(page)
        self._refcount[page] += 1

    def _pop_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._cached_free.popitem(last=False)
            page_hash = self._page_hash.pop(page)
            del self._hash_to_page[page_hash]
            tokens = self._page_tokens.pop(page)
            if self.host_tier is not None:
                self.host_tier.save(page_hash, tokens, page)
                self._restored.discard(page)
                self._from_disk.discard(page)
        self._refcount[page] = 1
        self._num_in_use += 1
        return page

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free, cached = set(self._free), set(self._cached_free)
        in_use = {p for p in range(self.num_pages) if self._refcount[p] > 0}
        assert len(free) == len(self._free), "duplicate page in the free list"
        assert not (free & cached) and not (free & in_use) and not (cached & in_use), \
            "a page is in two states"
        assert len(free) + len(cached) + len(in_use) == self.num_usable_pages, "page leak"
        assert NULL_PAGE not in free | cached | in_use, "the null page was handed out"
        assert len(in_use) == self._num_in_use
        counts = [0] * self.num_pages
        for rid, req in self._holders.items():
            assert req.request_id == rid and not req.is_finished, f"finished holder {rid}"
            assert len(set(req.page_table)) == len(req.page_table), f"{rid} holds a page twice"
            assert len(req.page_table) * self.page_size >= req.num_computed_tokens
            for p in req.page_table:
                counts[p] += 1
        for pin in self._pins.values():
            for p in pin.pages:
                counts[p] += 1
        assert sum(len(p.pages) for p in self._pins.values()) == self._num_pinned_pages
        assert self._num_pinned_pages <= max(self.max_pinned_pages, 0)
        assert counts == self._refcount, "refcounts disagree with the page tables"
        assert all(p in self._page_hash for p in cached), "an unindexed page is cached"
        assert {self._hash_to_page[h]: h for h in self._hash_to_page} == self._page_hash
        assert self._page_tokens.keys() == self._page_hash.keys()
        if not self.enable_prefix_caching:
            assert not self._hash_to_page
        if self.host_tier is not None:
            self.host_tier.check_invariants()
            assert self._restored <= self._page_hash.keys(), "a restored page is not indexed"
            assert self._from_disk <= self._restored

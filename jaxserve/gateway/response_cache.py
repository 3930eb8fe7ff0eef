"""The response cache (issue 39): a deterministic request's answer, kept for an exact repeat.

An entry is keyed by what fixes the answer: the tenant, the answering version (its name and
manifest id) and the canonical request (entrypoints/serving/response_caching.py builds the key
and decides what may be cached). It holds the response as it was sent (the JSON body, or the SSE
events of a stream), the version and route that answered, and lives `ttl_s` from when it was
stored. Memory is bounded twice: at most `max_entries` entries and `max_bytes` bytes of
responses; past either, the least recently used entries go first (an LRU). A response larger than
max_bytes / 8 is not kept. `invalidate` drops a route's or a version's entries when the fleet
changes them (a deploy, a rollback, new weights). Counters for /metrics: hits, misses, evictions
(by reason: size, expired, invalidated), and the entries and bytes held.

Host-side: no JAX. Thread-safe (request handlers and the fleet's admin calls both come in).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

HEADER = "x-jaxserve-cache"  # on each answer of a cacheable route: hit | miss | bypass
EVICTION_REASONS = ("size", "expired", "invalidated")


@dataclass(frozen=True)
class CachedAnswer:
    """An answer as it was sent: `body` (a JSON response) or `events` (a stream's SSE events, in
    order, [DONE] included); `version` and `route` answered it ("" for a version addressed by
    name); `finish_reasons`, per choice, for the replay's record; `degraded`: why its route
    degraded the original (a replay's x-jaxserve-degraded says so too)."""

    body: bytes | None
    events: tuple[bytes, ...]
    version: str
    route: str
    finish_reasons: tuple[str, ...] = ()
    degraded: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.body or b"") + sum(len(e) for e in self.events)


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: dict[str, int]  # by reason (EVICTION_REASONS)
    entries: int
    bytes: int


class ResponseCache:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 1 or max_bytes < 1 or not ttl_s > 0:
            raise ValueError("max_entries >= 1, max_bytes >= 1 and ttl_s > 0")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.max_answer_bytes = max(1, max_bytes // 8)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[float, CachedAnswer]] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = 0
        self._evictions = dict.fromkeys(EVICTION_REASONS, 0)

    def get(self, key: bytes) -> CachedAnswer | None:
        """The answer stored under `key` (now the most recently used), or None; counted as a hit
        or a miss."""
        with self._lock:
            item = self._entries.get(key)
            if item is not None and self._clock() >= item[0]:
                self._drop(key, "expired")
                item = None
            if item is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return item[1]

    def put(self, key: bytes, answer: CachedAnswer) -> bool:
        """Store `answer` for ttl_s (replacing what `key` held); False when it is too large to
        keep. Least recently used entries are evicted until both bounds hold."""
        with self._lock:
            if key in self._entries:
                self._drop(key, None)
            if answer.nbytes > self.max_answer_bytes:
                return False
            self._entries[key] = (self._clock() + self.ttl_s, answer)
            self._bytes += answer.nbytes
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)), "size")
            return True

    def invalidate(self, *, route: str | None = None, version: str | None = None) -> int:
        """Drop the entries a route answered (its versions changed) or a version answered (it
        was unloaded or replaced); returns how many."""
        with self._lock:
            gone = [k for k, (_, a) in self._entries.items()
                    if (route is not None and a.route == route)
                    or (version is not None and a.version == version)]
            for key in gone:
                self._drop(key, "invalidated")
            return len(gone)

    def _drop(self, key: bytes, reason: str | None) -> None:
        _, answer = self._entries.pop(key)
        self._bytes -= answer.nbytes
        if reason is not None:
            self._evictions[reason] += 1

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, dict(self._evictions),
                              len(self._entries), self._bytes)

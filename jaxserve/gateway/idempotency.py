"""Idempotency-Key (IETF draft "The Idempotency-Key HTTP Header Field"): a POST retried with the
same key runs once.

Per (tenant, key) the store keeps the fingerprint of the first request's body and, once it
completed, its response: the whole body, or for a stream the list of its SSE events. Then:
- a new key: the caller runs the request (`begin` returns None), then `complete`s or `abandon`s;
- the same key while the first is running: IdempotencyConflict (409);
- the same key with another body: IdempotencyMismatch (422);
- the same key and body after completion: the stored response, replayed as it was.
Only successful responses are stored (`abandon` the others, so a retry runs again).

Memory is bounded (cachetools.TTLCache): an entry lives `ttl_s` after its last change (default
24 h), and the entries' sizes (the stored bytes, counted as at least max_bytes / max_entries
each) never pass `max_bytes`, so there are at most `max_entries`; past that the least recently
used go first. A response larger than max_bytes / 8 is not stored: its key is forgotten and a
retry runs again. An in-flight entry evicted under pressure likewise lets a concurrent retry run.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

from cachetools import TTLCache

from jaxserve.errors import IdempotencyConflict, IdempotencyMismatch, InvalidRequest

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255


def parse_key(value: str | None) -> str | None:
    """The header's value (a quoted sf-string as the draft writes it, or bare as most clients send
    it): 1-255 printable ASCII characters."""
    if value is None:
        return None
    key = value.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not 0 < len(key) <= MAX_KEY_LENGTH or not all(" " <= c <= "~" for c in key):
        raise InvalidRequest(f"the {HEADER} header must be 1-{MAX_KEY_LENGTH} printable ASCII "
                             f"characters", HEADER)
    return key


def fingerprint(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


@dataclass(frozen=True)
class StoredResponse:
    """What a replay sends back: `body` for a plain response, `events` (SSE `data:` payloads, in
    order) for a stream; `headers` are the response's own (content type, request id, ...);
    `version`: the model version that answered, for the replay's audit record."""

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    events: tuple[bytes, ...] = ()
    version: str | None = None

    @property
    def nbytes(self) -> int:
        return (len(self.body or b"") + sum(len(e) for e in self.events)
                + sum(len(k) + len(v) for k, v in self.headers))


@dataclass(frozen=True)
class _Entry:
    fingerprint: bytes
    response: StoredResponse | None  # None: in flight


class IdempotencyStore:
    def __init__(self, ttl_s: float = 24 * 3600, max_entries: int = 10_000,
                 max_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_entries < 1 or max_bytes < max_entries:
            raise ValueError("ttl_s > 0, max_entries >= 1 and max_bytes >= max_entries")
        self.min_entry_size = max_bytes // max_entries
        self.max_response_bytes = max_bytes // 8
        self._cache: TTLCache = TTLCache(max_bytes, ttl_s, timer=clock,
                                         getsizeof=self._size)
        self._lock = threading.Lock()

    def _size(self, entry: _Entry) -> int:
        n = entry.response.nbytes if entry.response is not None else 0
        return max(self.min_entry_size, n + len(entry.fingerprint))

    def __len__(self) -> int:
        with self._lock:
            self._cache.expire()
            return len(self._cache)

    def begin(self, tenant: str, key: str, request_fingerprint: bytes) -> StoredResponse | None:
        """None: a new key, now in flight (run the request). Else the response to replay."""
        with self._lock:
            entry = self._cache.get((tenant, key))
            if entry is None:
                self._cache[(tenant, key)] = _Entry(request_fingerprint, None)
                return None
        if entry.fingerprint != request_fingerprint:
            raise IdempotencyMismatch(f"this {HEADER} was already used with a different request "
                                      f"body")
        if entry.response is None:
            raise IdempotencyConflict(f"a request with this {HEADER} is still being processed; "
                                      f"retry when it has finished")
        return entry.response

    def complete(self, tenant: str, key: str, request_fingerprint: bytes,
                 response: StoredResponse) -> None:
        """Store the response of a request `begin` let run."""
        with self._lock:
            if response.nbytes > self.max_response_bytes:
                self._cache.pop((tenant, key), None)
            else:
                self._cache[(tenant, key)] = _Entry(request_fingerprint, response)

    def abandon(self, tenant: str, key: str) -> None:
        """The request failed or was cancelled: forget the key, so a retry runs."""
        with self._lock:
            entry = self._cache.get((tenant, key))
            if entry is not None and entry.response is None:
                del self._cache[(tenant, key)]

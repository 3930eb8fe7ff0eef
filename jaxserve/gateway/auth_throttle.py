"""`AuthThrottle`: failed authentications counted per client, so keys cannot be guessed at the
speed of the network (review a70e490, H6 and M3).

A client (its address) whose keys failed `limit` times within one window is refused before its
key is checked, a right key too, until the window ends: a 429 with Retry-After. Clients behind
one proxy share its address and so its budget. The table holds at most `max_clients` windows; a
full table drops those already over (their clients start afresh)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from jaxserve.errors import ConfigError, RateLimitExceeded


class AuthThrottle:
    def __init__(self, limit: int, window_s: float = 60.0, max_clients: int = 65536,
                 clock: Callable[[], float] = time.monotonic):
        """`limit`: failures per client and window (0: no limit)."""
        if limit < 0 or not window_s > 0:
            raise ConfigError(f"the failed-authentication limit must be >= 0 (0: none), got "
                              f"{limit}")
        self.limit, self.window_s, self.max_clients = limit, window_s, max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int]] = {}  # client -> (window start, failures)

    def check(self, client: str) -> None:
        """RateLimitExceeded (429) while `client` is over its failures in this window."""
        if not self.limit:
            return
        now = self._clock()
        with self._lock:
            start, failures = self._windows.get(client, (now, 0))
        if failures >= self.limit and now < start + self.window_s:
            raise RateLimitExceeded(f"too many failed authentications from this address: "
                                    f"retry in {start + self.window_s - now:.0f} s",
                                    start + self.window_s - now)

    def failed(self, client: str) -> None:
        """One more failed authentication from `client`."""
        if not self.limit:
            return
        now = self._clock()
        with self._lock:
            start, failures = self._windows.get(client, (now, 0))
            if now >= start + self.window_s:
                start, failures = now, 0
            elif client not in self._windows and len(self._windows) >= self.max_clients:
                self._evict(now)
            self._windows[client] = (start, failures + 1)

    def _evict(self, now: float) -> None:
        for c, (start, _) in list(self._windows.items()):
            if now >= start + self.window_s:
                del self._windows[c]
        if len(self._windows) >= self.max_clients:
            self._windows.clear()

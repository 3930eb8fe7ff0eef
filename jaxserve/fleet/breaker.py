"""Circuit breakers, one per (route, version), when the route has a `breaker` table: a version
whose faults (5xx: its errors, not a client's, not a shed) over the window pass `max_error_rate`
opens, and while open the route sends its traffic to the route's other versions (weights
renormalised over those; none left: 503). After `open_seconds` it is half-open: one request at a
time is let through as a probe; a probe that answers closes it, one that fails opens it again.
A version whose engine has stalled (no step for --engine-stall-timeout with work pending) gets no
traffic from a route with a breaker while the stall lasts. Host-side: no JAX.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    max_error_rate: float = 0.5  # faults / requests in the window that open it
    min_requests: int = 10  # in the window, before judging
    window_seconds: float = 30.0
    open_seconds: float = 30.0  # open this long, then half-open

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Breaker:
    """Not thread-safe: the fleet calls it under its lock."""

    def __init__(self, config: BreakerConfig):
        self.config = config
        self.state = CLOSED
        self._window: deque[tuple[float, bool]] = deque()  # (time, fault) while closed
        self._opened_at = 0.0
        self._probing = False  # a half-open breaker's probe is in flight
        self.opened = 0  # times it opened

    def admits(self, now: float) -> bool:
        """Whether a request may go to the version now (taken or not)."""
        if self.state == OPEN and now - self._opened_at >= self.config.open_seconds:
            self.state, self._probing = HALF_OPEN, False
        return self.state == CLOSED or (self.state == HALF_OPEN and not self._probing)

    def take(self) -> bool:
        """A request was sent to the version; True when it is the half-open breaker's probe."""
        if self.state == HALF_OPEN:
            self._probing = True
            return True
        return False

    def record(self, now: float, fault: bool, probe: bool) -> None:
        """A request the breaker admitted ended (`fault`: the version's)."""
        if probe:
            self._probing = False
            if fault:
                self._open(now)
            else:
                self.state = CLOSED
            return
        if self.state != CLOSED:  # admitted before it opened: says nothing new
            return
        window = self._window
        window.append((now, fault))
        while window and window[0][0] < now - self.config.window_seconds:
            window.popleft()
        faults = sum(f for _, f in window)
        if len(window) >= self.config.min_requests and \
                faults / len(window) > self.config.max_error_rate:
            self._open(now)

    def released(self, probe: bool) -> None:
        """A request it admitted never ran (refused before the engine): a probe may go again."""
        if probe:
            self._probing = False

    def _open(self, now: float) -> None:
        self.state, self._opened_at = OPEN, now
        self._window.clear()
        self.opened += 1

    def to_dict(self) -> dict:
        return {"state": self.state, "opened": self.opened}

"""Refusals nobody can be held to, counted instead of recorded one by one (review a70e490, H6).

A call refused before its key was accepted (a 401, or the throttle's 429 before the key is
checked), or because the audit log itself cannot take records (a 503), served nothing and names no
tenant who could be billed or warned; one record each would let anyone grow the log as fast as
they can send. `RefusalCounts` counts them per (client, tenant) and hands out one `refusals`
summary per key and interval: how many, by status and route, and the key ids sent. Every bound
is fixed, so the log grows by at most `max_clients + 1` summaries per interval whatever is sent.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from jaxserve.audit.record import utc_now

MAX_DISTINCT = 16  # routes and key ids named per summary; the rest are counted
OTHER_CLIENTS = "*"  # the summary of clients past max_clients in one interval


@dataclass
class _Tally:
    since: str
    count: int = 0
    statuses: Counter = field(default_factory=Counter)
    routes: Counter = field(default_factory=Counter)
    more_routes: int = 0
    key_ids: list = field(default_factory=list)
    more_key_ids: int = 0

    def add(self, status: str, route: str, key_id: str | None) -> None:
        self.count += 1
        self.statuses[status] += 1
        if route in self.routes or len(self.routes) < MAX_DISTINCT:
            self.routes[route] += 1
        else:
            self.more_routes += 1
        if key_id is not None and key_id not in self.key_ids:
            if len(self.key_ids) < MAX_DISTINCT:
                self.key_ids.append(key_id)
            else:
                self.more_key_ids += 1


class RefusalCounts:
    """Thread-safe counts of one interval (see the module)."""

    def __init__(self, max_clients: int = 1024):
        self.max_clients = max_clients
        self._lock = threading.Lock()
        self._tallies: dict[tuple[str, str | None], _Tally] = {}

    def count(self, client: str | None, tenant: str | None, status: str, route: str,
              key_id: str | None) -> None:
        key = (client or "", tenant)
        with self._lock:
            tally = self._tallies.get(key)
            if tally is None:
                if len(self._tallies) >= self.max_clients:
                    key = (OTHER_CLIENTS, None)
                    tally = self._tallies.get(key)
                if tally is None:
                    tally = self._tallies[key] = _Tally(utc_now())
            tally.add(status, route, key_id)

    def take(self) -> list[dict]:
        """The interval's summaries (record bodies), and a new interval begins."""
        with self._lock:
            tallies, self._tallies = self._tallies, {}
        return [{"type": "refusals", "ts": utc_now(), "since": t.since, "client": client,
                 "tenant": tenant, "count": t.count, "statuses": dict(t.statuses),
                 "routes": dict(t.routes), "more_routes": t.more_routes,
                 "key_ids": t.key_ids, "more_key_ids": t.more_key_ids}
                for (client, tenant), t in tallies.items()]

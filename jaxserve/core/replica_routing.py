"""Which data-parallel replica takes a request: prefix-cache affinity, bounded by load.

Plain Python (no JAX), so the rule is tested in milliseconds. The rule:

1. For every replica, `cached_pages` counts the leading full pages of the prompt its prefix cache
   holds now, and `load` the sequences it is running or has queued.
2. A replica is *much busier* when its load exceeds the least-loaded replica's by `max_imbalance`
   or more; those are passed over (the least-loaded replica never is).
3. Among the others, the one with the longest cached prefix wins; ties go to the lower load, then
   to the lower index.

So a prompt whose system prompt or conversation a replica has cached goes back to that replica
while it has room, and a prompt nobody has cached goes to the least-loaded replica.
"""

from __future__ import annotations

from typing import Sequence


def pick_replica(cached_pages: Sequence[int], loads: Sequence[int], max_imbalance: int) -> int:
    if not loads or len(cached_pages) != len(loads):
        raise ValueError(f"{len(cached_pages)} prefix counts for {len(loads)} replicas")
    if max_imbalance < 1:
        raise ValueError(f"max_imbalance must be >= 1, got {max_imbalance}")
    least = min(loads)
    eligible = [r for r, load in enumerate(loads) if load - least < max_imbalance]
    return max(eligible, key=lambda r: (cached_pages[r], -loads[r], -r))

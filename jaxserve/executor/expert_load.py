"""A mixture of experts' load: how many tokens each expert took, for the jaxserve:moe_* metrics.

Every forward of a mixture returns its step's counts, i32 [E] summed over the sparse layers
(decoder.forward_with_expert_tokens), computed on the device. They stay there: a step only
appends its array to a list, and every FOLD_STEPS steps the list comes to the host in one small
transfer (FOLD_STEPS x E int32, of finished steps) and is added up in int64. Reading the totals
never touches the device, so they lag the steps by fewer than FOLD_STEPS.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

FOLD_STEPS = 64


class ExpertLoad:
    def __init__(self, num_experts: int, expert_parallel_size: int = 1):
        self.expert_parallel_size = expert_parallel_size  # device d holds a contiguous E / n
        self._tokens = np.zeros(num_experts, np.int64)
        self._steps = 0
        self._pending: list[jax.Array] = []
        self._lock = threading.Lock()  # the engine thread adds, a metrics scrape may read

    def add(self, counts: jax.Array) -> None:
        """One step's counts i32 [E], still on the device (the engine thread)."""
        self._pending.append(counts)
        if len(self._pending) >= FOLD_STEPS:
            self.fold()

    def fold(self) -> None:
        """Bring the pending steps' counts to the host now (the engine thread)."""
        pending, self._pending = self._pending, []
        if pending:
            total = np.sum(jax.device_get(pending), axis=0, dtype=np.int64)
            with self._lock:
                self._tokens += total
                self._steps += len(pending)

    def totals(self) -> tuple[tuple[int, ...], int]:
        """(tokens routed to each expert, summed over the sparse layers; the steps counted)."""
        with self._lock:
            return tuple(int(t) for t in self._tokens), self._steps

"""The host's gap between engine steps: how long the device waits for Python between one step's
sampled tokens being ready and the next step's forward being launched (scheduling, sampler
inputs, output processing, detokenization, and in a server the delivery of the outputs).

Counted only for a step launched right after one that sampled, with work left in between (an
idle engine waiting for requests is not a gap). With async scheduling (LLMEngine) the next step
is launched while the previous one still runs: that launch counts as queued ahead, with a gap of
0. When the previous step had already finished, the gap is measured from the moment the host
first saw it finished: a lower bound, since it may have finished earlier (the device does not
tell when). Without async scheduling the host reads each step's tokens as soon as they are
ready, so its gap is exact.
"""

from __future__ import annotations

import time


class StepGaps:
    def __init__(self):
        self.num_gaps = 0
        self.gap_seconds = 0.0
        self.num_queued_ahead = 0  # steps launched before the previous one finished
        self._ready_at: float | None = None  # when the host saw the last step's tokens ready

    def ready(self) -> None:
        """The last step's tokens are ready (read, or seen done)."""
        if self._ready_at is None:
            self._ready_at = time.perf_counter()

    def launched(self, previous_running: bool) -> None:
        """A forward was launched; `previous_running`: the step before it has not finished."""
        if previous_running:
            self.num_gaps += 1
            self.num_queued_ahead += 1
        elif self._ready_at is not None:
            self.num_gaps += 1
            self.gap_seconds += time.perf_counter() - self._ready_at
        self._ready_at = None

    def idle(self) -> None:
        """No work is left: the time until the next step is the clients', not the host's."""
        self._ready_at = None

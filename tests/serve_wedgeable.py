"""`jaxserve serve` whose engine wedges for good once it holds a request with seed WEDGE_SEED: a
stand-in for a device call that never returns. Only a test starts a server this way
(`python -m tests.serve_wedgeable serve ...`); `jaxserve serve` has no such hook."""

from __future__ import annotations

import sys
import threading

from jaxserve.entrypoints import cli
from jaxserve.core.engine import LLMEngine

WEDGE_SEED = 4242
_step = LLMEngine.step


def step_or_wedge(self: LLMEngine):
    if any(g.prepared.params.seed == WEDGE_SEED for g in self.output_processor.groups.values()):
        threading.Event().wait()  # never set: this step never returns
    return _step(self)


if __name__ == "__main__":  # only then: importing WEDGE_SEED (a test does) patches nothing
    LLMEngine.step = step_or_wedge
    sys.exit(cli.main())

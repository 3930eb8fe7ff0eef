"""`jaxserve serve` whose engine steps each take STEP_DELAY_ENV seconds longer while it has work:
a prefill long enough to kill a server in the middle of, on any host. Only a test starts a
server this way (`python -m tests.serve_slowed serve ...`); `jaxserve serve` has no such hook."""

from __future__ import annotations

import os
import sys
import time

from jaxserve.entrypoints import cli
from jaxserve.core.engine import LLMEngine

STEP_DELAY_ENV = "JAXSERVE_TEST_STEP_DELAY_S"
_step = LLMEngine.step


def slowed_step(self: LLMEngine):
    if self.has_unfinished():
        time.sleep(float(os.environ[STEP_DELAY_ENV]))
    return _step(self)


if __name__ == "__main__":  # only then: importing STEP_DELAY_ENV (a test does) patches nothing
    LLMEngine.step = slowed_step
    sys.exit(cli.main())

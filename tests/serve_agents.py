"""`jaxserve serve` for the agent-run restart test, with two test knobs: each engine step that has
work takes SLOW_STEP_S longer (so the test can kill the server in the middle of a model turn),
and retrieval uses the tiny random encoder (its warmup compiles in seconds; the real one's takes
minutes on a loaded CI machine). Only a test starts a server this way
(`python -m tests.serve_agents serve ...`); `jaxserve serve` has no such hooks."""

from __future__ import annotations

import sys
import time

from jaxserve.core.engine import LLMEngine
from jaxserve.entrypoints import cli, launcher
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from tests.rag_helpers import tiny_embedder

SLOW_STEP_S = 0.05
_step = LLMEngine.step


def slow_step(self: LLMEngine):
    if self.output_processor.groups:
        time.sleep(SLOW_STEP_S)
    return _step(self)


def tiny_rag_service(data_dir, quotas):
    return RagService(RagConfig(data_dir, EmbedderConfig(max_batch=4, max_length=64),
                                ChunkerConfig(chunk_tokens=48, overlap_tokens=8), quotas=quotas),
                      tiny_embedder())


LLMEngine.step = slow_step
launcher._rag_service = tiny_rag_service

if __name__ == "__main__":
    sys.exit(cli.main())

"""`jaxserve serve` for the agent-run restart test, with two test knobs: with
HOLD_REQUEST_ENV=N in its environment the engine stops for good a few steps into the N-th request
it runs (so the test can kill the server in the middle of that model turn, on any host, without
racing it), and retrieval uses the tiny random encoder (its warmup compiles in seconds; the real
one's takes minutes on a loaded CI machine). Only a test starts a server this way
(`python -m tests.serve_agents serve ...`); `jaxserve serve` has no such hooks."""

from __future__ import annotations

import os
import sys
import threading

from jaxserve.core.engine import LLMEngine
from jaxserve.entrypoints import cli, launcher
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from tests.rag_helpers import tiny_embedder

HOLD_REQUEST_ENV = "SERVE_AGENTS_HOLD_REQUEST"
HOLD_AFTER_STEPS = 4  # steps of the held request that run: the kill lands mid-turn, not before it
_hold_request = int(os.environ.get(HOLD_REQUEST_ENV, "0"))
_seen: list[str] = []  # request ids in the order the engine first ran them
_held_steps = 0
_step = LLMEngine.step


def holding_step(self: LLMEngine):
    global _held_steps
    _seen.extend(r for r in self.output_processor.groups if r not in _seen)
    if 0 < _hold_request <= len(_seen) and _seen[_hold_request - 1] in self.output_processor.groups:
        _held_steps += 1
        if _held_steps > HOLD_AFTER_STEPS:
            threading.Event().wait()  # until the test's SIGKILL
    return _step(self)


def tiny_rag_service(data_dir, quotas):
    return RagService(RagConfig(data_dir, EmbedderConfig(max_batch=4, max_length=64),
                                ChunkerConfig(chunk_tokens=48, overlap_tokens=8), quotas=quotas),
                      tiny_embedder())


if __name__ == "__main__":  # (the test imports HOLD_REQUEST_ENV: patch only the server)
    LLMEngine.step = holding_step
    launcher._rag_service = tiny_rag_service
    sys.exit(cli.main())

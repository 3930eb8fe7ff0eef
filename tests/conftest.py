"""Shared fixtures: golden outputs and the real SmolLM2 model, loaded once per session.

Tests of the layers above the engine (HTTP, gRPC, batch, policy, tenancy, audit, TLS, replicas)
start their engines with min_token_bucket=16: small steps are the engine tests' subject, and each
bucket below 16 is one more forward, and one more row count of samplers, to compile per engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# JAXSERVE_GOLDEN_DIR: where a checkout has no ../shared beside it (benchmarks/accelerator_check.py)
GOLDEN_DIR = Path(os.environ.get("JAXSERVE_GOLDEN_DIR")
                  or Path(__file__).resolve().parents[2] / "shared" / "golden")
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _persistent_compile_cache_stays_with_its_test():
    """A test that runs an engine command in-process (cli.main) turns on JAX's persistent
    compilation cache for the whole process, and every later engine here would read and write it.
    That crashed the suite in XLA's deserializer (a segfault under warmup's worker thread, CI of
    stop 46), so the setting ends with the test that made it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def smollm2_golden() -> dict:
    return json.loads((GOLDEN_DIR / "smollm2_golden.json").read_text())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The GGUF, fetched and verified by the same code path `make serve` uses."""
    from jaxserve.model_registry import fetch

    return fetch(SMOLLM2, quiet=True)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(config, params) of SmolLM2 in float32 on the default device."""
    from jaxserve.model_registry import resolve
    from jaxserve.weights import load_model

    return load_model(resolve(SMOLLM2), dtype="float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer_fields(smollm2_path) -> dict:
    """SmolLM2's tokenizer metadata, for tiny random models that encode prompts for real."""
    from jaxserve.gguf_file import GGUFFile

    reader = GGUFFile(str(smollm2_path))
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.chat_template")
    return {k: reader.fields[k].contents() for k in keys}

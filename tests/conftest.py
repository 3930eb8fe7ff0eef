"""Shared fixtures: golden outputs and the real SmolLM2 model, loaded once per session.

Tests of the layers above the engine (HTTP, gRPC, batch, policy, tenancy, audit, TLS, replicas)
start their engines with min_token_bucket=16: small steps are the engine tests' subject, and each
bucket below 16 is one more forward, and one more row count of samplers, to compile per engine."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import jax
import pytest
from aiohttp import web_app

from tests import kernel_prebuild

# JAXSERVE_GOLDEN_DIR: where a checkout has no ../shared beside it (benchmarks/accelerator_check.py)
GOLDEN_DIR = Path(os.environ.get("JAXSERVE_GOLDEN_DIR")
                  or Path(__file__).resolve().parents[2] / "shared" / "golden")
SMOLLM2 = "smollm2-135m-instruct"

# JAX's persistent compilation cache stays off in the suite's own process: a test that runs an
# engine command in-process (cli.main) would turn it on for the whole process
# (`--compile-cache-dir`'s default), and every later test's engines would share one cache.
# Servers the tests start as subprocesses still use it, as users' do.
jax.config.update("jax_enable_compilation_cache", False)

_PREBUILD = pytest.StashKey[kernel_prebuild.Prebuild]()


def pytest_collection_finish(session):
    if kernel_prebuild.wanted(session.items):
        session.config.stash[_PREBUILD] = kernel_prebuild.Prebuild()


def pytest_sessionfinish(session):
    if _PREBUILD in session.config.stash:
        session.config.stash[_PREBUILD].close()


@pytest.fixture(scope="session")
def older_x86_prebuild(request) -> kernel_prebuild.Prebuild:
    """The older-x86 kernel builds started at collection (tests/kernel_prebuild.py)."""
    return request.config.stash[_PREBUILD]


@pytest.fixture
def private_compile_cache(tmp_path):
    """A directory for the test's own persistent compilation cache, on for this test only: a test
    that runs one command in-process several times (cli.main, each run a new engine) passes it
    as `--compile-cache-dir` and compiles each program once, as a user's repeated runs do."""
    from jax._src import compilation_cache

    path = tmp_path / "xla"
    # JAX opens its cache once, at the first compile after it is enabled; reset on both sides so
    # this test's programs go to this directory and later tests' to none.
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        yield path
    finally:
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def _release_module_servers():
    """After each module: its servers' engines, and their compiled programs, are freed.

    aiohttp caches each app's middleware chain (an lru_cache of 1024 entries keyed by the app),
    so every in-process test server's app, and through it its engine, outlived its module. XLA's
    CPU programs each hold memory mappings, and at ~90% of the suite the process ran past
    vm.max_map_count (65,530): compiling then aborted inside XLA (both CI runs of stop 46 crashed
    so, in runner.warmup)."""
    yield
    web_app._cached_build_middleware.cache_clear()
    gc.collect()
    # A leak shows here as an error naming the module, not later as a crash in some compile.
    maps, limit = Path("/proc/self/maps"), Path("/proc/sys/vm/max_map_count")
    if maps.exists() and limit.exists():
        held, most = len(maps.read_text().splitlines()), int(limit.read_text())
        if held > most // 2:
            pytest.fail(f"{held} memory mappings (of vm.max_map_count {most}) are left after the "
                        f"module's teardown: something keeps its engines' programs alive")


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
    """(config, params) of SmolLM2 in float32 on the default device, as loaded by default (the
    GGUF's blocks kept where the CPU kernels read them)."""
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

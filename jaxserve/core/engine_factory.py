"""The one way to build an engine, for `--model`, a deployment's versions, the admin API, the
offline `LLM`, benchmarks and tests alike.

`build_engines` resolves the model, checks the parallel sizes against the devices and the model's
config (before a tensor is read), reads the weights once and places them on one (1, tp) mesh per
data-parallel replica, gives every replica the same KV pool size, loads the tokenizer, and builds
one LLMEngine per replica, compiling the replicas' programs side by side. `start_engine` wraps
them for a front end: an AsyncEngine for one replica, a ReplicaSet for several. A multi-host group
builds through the same path, passing its agreement and step hooks (jaxserve.executor.multihost).

Host side: the devices are the executor's business (jaxserve.executor.parallel), asked inside
the functions so that importing this module loads no JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from jaxserve.config import EngineConfig
from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine import LLMEngine
from jaxserve.core.replicas import ReplicaSet
from jaxserve.core.serving_engine import ServingEngine
from jaxserve.engine_settings import make_engine_config, parallel_config
from jaxserve.errors import ConfigError


def build_engines(model: str, *, strict_compile: bool = False, warmup: bool = True,
                  progress: bool = True,
                  agree_num_pages: Callable[[int, str], int] | None = None,
                  publish: Callable | None = None, **settings: Any) -> list[LLMEngine]:
    """One LLMEngine per data-parallel replica of `model` (a registered name or a path).
    settings: engine settings by name (jaxserve.engine_settings) over the registry's defaults.
    agree_num_pages(num_pages, config fingerprint) -> the pool size every process of a multi-host
    group uses; publish: the leader's step hook (jaxserve.executor.multihost)."""
    from jaxserve.executor import parallel
    from jaxserve.model_registry import resolve
    from jaxserve.tokenizer import load_tokenizer
    from jaxserve.weights import load_model_replicas, read_config

    spec = resolve(model)
    started = time.perf_counter()
    args = {**spec.engine_defaults, **{k: v for k, v in settings.items() if v is not None}}
    dtype, quantization, gguf_dot, chat_template = (
        args.pop(k, None) for k in ("dtype", "quantization", "gguf_dot", "chat_template"))
    sizes = parallel_config(args)
    if quantization not in (None, "none") and sizes.tensor_parallel_size > 1:
        # The scales of a group span heads (o_proj): they do not shard with them.
        raise ConfigError(f"quantization {quantization!r} is not supported with "
                          f"tensor_parallel_size > 1")
    parallel.check_sizes(read_config(spec, dtype), sizes)
    meshes = parallel.replica_meshes(sizes)
    model_config, replica_params = parallel.wait_until_ready(
        load_model_replicas(spec, dtype, meshes, quantization, sizes.enable_expert_parallel))
    if gguf_dot is not None:  # (ModelConfig says when the blocks it needs are not kept)
        model_config = model_config.replace(gguf_dot=gguf_dot)
    load_seconds = time.perf_counter() - started
    parallel.warn_if_kv_heads_replicated(model_config, meshes[0])
    config = make_engine_config(model_config, args)
    num_pages = parallel.pool_size(config, meshes)
    if agree_num_pages is not None:
        num_pages = agree_num_pages(num_pages, _fingerprint(config))
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                   num_pages=num_pages))
    tokenizer = load_tokenizer(spec, chat_template)
    engines = [LLMEngine(config, params, tokenizer, mesh=mesh, strict_compile=strict_compile,
                         warmup=False, publish=publish)
               for mesh, params in zip(meshes, replica_params)]
    started = time.perf_counter()
    if warmup:
        # Compiling releases the GIL: the replicas' programs compile side by side.
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda i: engines[i].runner.warmup(progress and i == 0),
                          range(len(engines))))
    for engine in engines:  # time to ready, for the start-up line (the replicas' wall time)
        engine.load_seconds, engine.compile_seconds = load_seconds, time.perf_counter() - started
    return engines


def build_engine(model: str, **kwargs: Any) -> LLMEngine:
    """The one LLMEngine of `model` (the offline API, tests): build_engines' arguments."""
    engines = build_engines(model, **kwargs)
    if len(engines) > 1:
        raise ConfigError(
            f"an LLMEngine is one replica: data_parallel_size {len(engines)} is served by "
            f"`jaxserve serve` / `jaxserve batch` (jaxserve.core.engine_factory.start_engine)")
    return engines[0]


def start_engine(model: str, *, stall_timeout: float | None = 60.0,
                 **kwargs: Any) -> ServingEngine:
    """The engine a front end serves: an AsyncEngine, or a ReplicaSet of one per replica.
    stall_timeout: see AsyncEngine; kwargs: build_engines'."""
    engines = [AsyncEngine(e, stall_timeout=stall_timeout)
               for e in build_engines(model, **kwargs)]
    return engines[0] if len(engines) == 1 else ReplicaSet(engines)


def _fingerprint(config: EngineConfig) -> str:
    """What must be equal on every process of a multi-host group for their programs to match."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]

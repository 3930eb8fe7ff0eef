"""Engines from the parallel settings: tensor_parallel_size x data_parallel_size devices.

`build_engines` checks the sizes against the devices and the model's config (before reading a
tensor), reads the weights once, places them on one (1, tp) mesh per data-parallel replica
(jaxserve.executor.sharding), gives every replica the same KV pool size, and builds one LLMEngine per
replica, compiling the replicas' programs side by side. `start_engine` wraps them for a front
end: an AsyncEngine for one replica, a ReplicaSet for several.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

from jaxserve.executor import sharding
from jaxserve.config import EngineConfig
from jaxserve.core.engine import LLMEngine
from jaxserve.engine_settings import make_engine_config, parallel_config
from jaxserve.errors import ConfigError

log = logging.getLogger(__name__)


def config_fingerprint(config: EngineConfig) -> str:
    """What must be equal on every process of a multi-host group for their programs to match."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:16]


def build_engines(model: str, *, dtype: str | None = None, devices=None,
                  strict_compile: bool = False, warmup: bool = True, progress: bool = True,
                  chat_template: str | None = None,
                  agree_num_pages: Callable[[int, str], int] | None = None,
                  publish: Callable | None = None, **engine_args: Any) -> list[LLMEngine]:
    """One LLMEngine per data-parallel replica of `model` (a registered name or a path).
    engine_args: CacheConfig / SchedulerConfig / ParallelConfig fields over the registry's;
    chat_template: a jinja chat template (a file, or the text) instead of the model's.
    agree_num_pages(num_pages, config fingerprint) -> the pool size every process of a multi-host
    group uses; publish: the leader's step hook (jaxserve.executor.multihost)."""
    from jaxserve.model_registry import resolve
    from jaxserve.executor.runner import num_pages_for
    from jaxserve.tokenizer import load_tokenizer
    from jaxserve.weights import load_model_replicas, read_config

    spec = resolve(model)
    started = time.perf_counter()
    args = {**spec.engine_defaults, **engine_args}
    quantization = args.pop("quantization", None)
    parallel = parallel_config(args)
    if quantization is not None and parallel.tensor_parallel_size > 1:
        # The scales of a group span heads (o_proj): they do not shard with them.
        raise ConfigError(f"quantization {quantization!r} is not supported with "
                          f"tensor_parallel_size > 1")
    devices = list(jax.devices() if devices is None else devices)
    # Checked before a tensor is read: a size that cannot serve is one error at start.
    sharding.check_parallel(read_config(spec, dtype), parallel, len(devices))
    if parallel.data_parallel_size * parallel.tensor_parallel_size == 1:
        meshes = [None]
    else:
        meshes = sharding.replica_meshes(parallel, devices)
    model_config, replica_params = jax.block_until_ready(
        load_model_replicas(spec, dtype, meshes, quantization))
    load_seconds = time.perf_counter() - started
    tp = parallel.tensor_parallel_size
    if tp > 1 and sharding.kv_head_shards(model_config, meshes[0]) == 1:
        log.warning("tensor_parallel_size %d does not divide the %d KV heads: attention runs "
                    "whole on every device and each holds the whole KV cache", tp,
                    model_config.num_kv_heads)
    config = make_engine_config(model_config, args)
    # Every replica gets the smallest pool any of them has room for: one validation fits all.
    num_pages = min(num_pages_for(config.model, config.cache, config.scheduler, mesh)
                    for mesh in meshes)
    if agree_num_pages is not None:
        num_pages = agree_num_pages(num_pages, config_fingerprint(config))
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


def start_engine(model: str, *, stall_timeout: float | None = 60.0, **kwargs: Any):
    """The engine a front end serves: an AsyncEngine, or a ReplicaSet of one per replica.
    stall_timeout: see AsyncEngine."""
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.replicas import ReplicaSet

    engines = [AsyncEngine(e, stall_timeout=stall_timeout)
               for e in build_engines(model, **kwargs)]
    return engines[0] if len(engines) == 1 else ReplicaSet(engines)

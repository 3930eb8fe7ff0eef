"""The device side of building engines: parallel sizes checked against the devices, one mesh per
data-parallel replica, the KV pool size every replica has room for, and the free memory a fleet
plans with. The engine factory (jaxserve.core.engine_factory) asks these; nothing here knows of
engines, weights files or tokenizers.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.config import EngineConfig, ModelConfig, ParallelConfig
from jaxserve.executor import sharding

log = logging.getLogger(__name__)


def check_sizes(config: ModelConfig, parallel: ParallelConfig) -> None:
    """One clear error at start for sizes that cannot serve this model on this process's
    devices (before a tensor is read)."""
    sharding.check_parallel(config, parallel, len(jax.devices()))


def replica_meshes(parallel: ParallelConfig) -> list:
    """One (1, tp) mesh per data-parallel replica; [None] (the default device) for one device."""
    if parallel.data_parallel_size * parallel.tensor_parallel_size == 1:
        return [None]
    return sharding.replica_meshes(parallel, jax.devices())


def warn_if_kv_heads_replicated(config: ModelConfig, mesh) -> None:
    tp = mesh.shape[sharding.MODEL] if mesh is not None else 1
    # (Latent attention's cache is replicated by design, its heads split all the same.)
    if tp > 1 and config.mla is None and sharding.kv_head_shards(config, mesh) == 1:
        log.warning("tensor_parallel_size %d does not divide the %d KV heads: attention runs "
                    "whole on every device and each holds the whole KV cache", tp,
                    config.num_kv_heads)


def pool_size(config: EngineConfig, meshes: list) -> int:
    """The smallest KV pool any replica has room for: every replica gets it, so one validation
    fits all."""
    from jaxserve.executor.runner import num_pages_for

    return min(num_pages_for(config.model, config.cache, config.scheduler, mesh)
               for mesh in meshes)


def wait_until_ready(tree):
    """`tree` once every array in it is on its devices (loading is asynchronous)."""
    return jax.block_until_ready(tree)


def free_device_memory() -> int:
    """What the default device can still allocate (a CPU's: the host's available memory)."""
    from jaxserve.executor.runner import free_memory_bytes

    return free_memory_bytes(jax.devices()[0])

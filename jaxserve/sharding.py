"""Device mesh and the one table that maps logical axes to mesh axes, for params and KV cache.

Tensor parallelism shards attention heads, KV heads, the MLP hidden axis and the vocabulary on the
"model" mesh axis; everything is replicated over "data" (data parallel replicas serve different
requests). An axis whose size the model axis does not divide is replicated instead — e.g. 3 KV
heads on 4 or 8 devices — so any TP size runs, at the cost of duplicated work on that tensor.
Sharded jitted code is partitioned by XLA (GSPMD) from these input shardings.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig, ParallelConfig
from jaxserve.errors import ConfigError

DATA, MODEL = "data", "model"

# Logical axis name (see jaxserve.models.llama) -> mesh axis, or None for replicated.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,
    "head_dim": None,
    "heads": MODEL,
    "kv_heads": MODEL,
    "mlp": MODEL,
    "vocab": MODEL,
    "cache_pages": None,
    "page_offset": None,
}

# Axes of the KV cache [L * num_pages, page_size, 2 * Hkv, D]: K/V pairs of a head are adjacent on
# axis 2, so a contiguous shard of it holds whole heads' K and V.
KV_CACHE_AXES = ("cache_pages", "page_offset", "kv_heads", "head_dim")


def make_mesh(parallel: ParallelConfig = ParallelConfig(), devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    if dp * tp > len(devices):
        raise ConfigError(
            f"data_parallel_size x tensor_parallel_size = {dp * tp} exceeds the {len(devices)} "
            f"available devices")
    return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), (DATA, MODEL))


def mesh_spec(logical: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Logical names -> mesh axes via the rule table, replicating axes the mesh does not divide."""
    axes = []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        mesh_axis = LOGICAL_AXIS_RULES[name] if name is not None else None
        if mesh_axis is not None and size % mesh.shape[mesh_axis]:
            mesh_axis = None
        axes.append(mesh_axis)
    return PartitionSpec(*axes)


def param_shardings(config: ModelConfig, mesh: Mesh) -> dict:
    """NamedSharding for every parameter of the model, same tree as its params."""
    from jaxserve.models import llama

    logical = llama.param_logical_axes(config)
    shapes = llama.param_shapes(config)
    return jax.tree.map(lambda spec, s: NamedSharding(mesh, mesh_spec(spec, s.shape, mesh)),
                        logical, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def kv_cache_sharding(config: ModelConfig, mesh: Mesh, num_pages: int,
                      page_size: int) -> NamedSharding:
    """Sharding of the cache [L * num_pages, page_size, 2 * Hkv, D]: KV heads on "model"."""
    # Divisibility is tested on Hkv, not 2 * Hkv: a shard must hold whole heads' K/V pairs.
    by_heads = (config.num_layers * num_pages, page_size, config.num_kv_heads, config.head_dim)
    return NamedSharding(mesh, mesh_spec(PartitionSpec(*KV_CACHE_AXES), by_heads, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

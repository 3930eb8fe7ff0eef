"""Device mesh and the one table that maps logical axes to mesh axes, for params and KV cache.

Tensor parallelism shards attention heads, KV heads, the MLP hidden axis and the vocabulary on the
"model" mesh axis; everything is replicated over "data" (data parallel replicas serve different
requests, each on its own (1, tp) slice of the devices: `replica_meshes`). An axis whose size the
model axis does not divide is replicated instead — e.g. 3 KV heads on 4 or 8 devices — so a TP size
runs as long as it splits the heads or the MLP (`check_parallel`), at the cost of duplicated work
on the replicated tensors. Sharded jitted code is partitioned by XLA (GSPMD) from these shardings,
except attention: the kernels are custom calls XLA cannot partition, so the model runs them under
`shard_map` on each device's own KV heads (`attention_specs`) and the cache is never gathered.
Expert parallelism (ModelConfig.expert_parallel) places a mixture's experts on the same "model"
axis by their `expert` axis (EXPERT_PARALLEL_RULES) instead of splitting each expert's MLP; the
MoE layer dispatches tokens to them itself (jaxserve.executor.models.moe, `shard_map` too).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig, ParallelConfig
from jaxserve.errors import ConfigError

DATA, MODEL = "data", "model"

# Logical axis name (the models declare theirs, e.g. decoder.param_logical_axes) -> mesh axis, or
# None for replicated.
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
    "quant_rows": None,  # GGUF and int8 blocks' rows and bytes (not with tensor parallelism)
    "quant_bytes": None,
    "expert": None,  # a mixture's per-expert weights: on "model" with expert parallelism
    "router": None,  # the router's per-expert columns: every device routes every token
    "latent": None,  # latent attention's low ranks (its cache is replicated: every head reads it)
}

# Expert parallelism: the experts on the model axis rather than each expert's MLP width (a mesh axis
# shards one dimension of a tensor at most: `mesh_spec` gives it to the first that asks).
EXPERT_PARALLEL_RULES = {**LOGICAL_AXIS_RULES, "expert": MODEL}

# Axes of the KV cache [L * num_pages, page_size, 2 * Hkv, D]: K/V pairs of a head are adjacent on
# axis 2, so a contiguous shard of it holds whole heads' K and V.
KV_CACHE_AXES = ("cache_pages", "page_offset", "kv_heads", "head_dim")


def check_devices(parallel: ParallelConfig, num_devices: int) -> None:
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    if dp * tp > num_devices:
        raise ConfigError(
            f"data_parallel_size x tensor_parallel_size = {dp} x {tp} = {dp * tp} exceeds the "
            f"{num_devices} available devices")


def check_parallel(config: ModelConfig, parallel: ParallelConfig, num_devices: int) -> None:
    """One clear error at start for sizes that cannot serve this model on these devices."""
    check_devices(parallel, num_devices)
    tp = parallel.tensor_parallel_size
    if parallel.enable_expert_parallel:
        check_expert_parallel(config, tp, num_devices // parallel.data_parallel_size)
    elif tp > 1 and config.num_heads % tp and config.intermediate_size % tp:
        fits = [n for n in range(2, num_devices // parallel.data_parallel_size + 1)
                if not config.num_heads % n or not config.intermediate_size % n]
        raise ConfigError(
            f"tensor_parallel_size {tp} divides neither the {config.num_heads} attention heads nor "
            f"the MLP width {config.intermediate_size} of {config.name}: every device would hold "
            f"and run whole layers (sizes that fit these devices: {fits or [1]})")


def check_expert_parallel(config: ModelConfig, ep: int, max_devices: int) -> None:
    """Expert parallelism over `ep` devices needs experts that split evenly over them (attention
    may not: it then runs whole on every device)."""
    if not config.num_experts:
        raise ConfigError(f"enable_expert_parallel needs a mixture-of-experts model; {config.name} "
                          f"is dense")
    if config.num_experts % ep:
        fits = [n for n in range(1, max_devices + 1) if not config.num_experts % n]
        raise ConfigError(f"expert parallelism over tensor_parallel_size {ep} devices: the "
                          f"{config.num_experts} experts of {config.name} are not divisible by "
                          f"{ep} (sizes that fit these devices: {fits})")


def axis_rules(config: ModelConfig) -> dict[str, str | None]:
    """The rule table this model's params are placed by."""
    return EXPERT_PARALLEL_RULES if config.expert_parallel else LOGICAL_AXIS_RULES


def make_mesh(parallel: ParallelConfig = ParallelConfig(), devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    check_devices(parallel, len(devices))
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), (DATA, MODEL))


def replica_meshes(parallel: ParallelConfig, devices=None) -> list[Mesh]:
    """One (1, tp) mesh per data-parallel replica: row r of the (dp, tp) mesh."""
    full = make_mesh(parallel, devices)
    return [Mesh(full.devices[r:r + 1], full.axis_names) for r in range(full.shape[DATA])]


def mesh_spec(logical: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
              rules: dict[str, str | None] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Logical names -> mesh axes via the rule table, replicating axes the mesh does not divide
    and axes whose mesh axis an earlier one took."""
    axes = []
    for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        mesh_axis = rules[name] if name is not None else None
        if mesh_axis is not None and (size % mesh.shape[mesh_axis] or mesh_axis in axes):
            mesh_axis = None
        axes.append(mesh_axis)
    return PartitionSpec(*axes)


def named_shardings(logical_axes: dict, shapes: dict, mesh: Mesh,
                    rules: dict[str, str | None] = LOGICAL_AXIS_RULES) -> dict:
    """NamedSharding for every leaf of a tree of arrays, e.g. a model's params: `logical_axes`
    holds a PartitionSpec of logical names per leaf and `shapes` their shapes, as the model
    declares them (decoder.param_shardings passes its own, and its rules: `axis_rules`)."""
    return jax.tree.map(lambda spec, s: NamedSharding(mesh, mesh_spec(spec, s.shape, mesh, rules)),
                        logical_axes, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def kv_cache_sharding(config: ModelConfig, mesh: Mesh, num_pages: int,
                      page_size: int) -> NamedSharding:
    """Sharding of the cache [L * num_pages, page_size, 2 * Hkv, D]: KV heads on "model".
    Latent attention's cache [L * num_pages, page_size, latent] is replicated."""
    if config.mla is not None:
        return NamedSharding(mesh, PartitionSpec())
    # Divisibility is tested on Hkv, not 2 * Hkv: a shard must hold whole heads' K/V pairs.
    by_heads = (config.num_layers * num_pages, page_size, config.num_kv_heads, config.head_dim)
    return NamedSharding(mesh, mesh_spec(PartitionSpec(*KV_CACHE_AXES), by_heads, mesh))


def kv_head_shards(config: ModelConfig, mesh: Mesh) -> int:
    """Devices one page's KV heads are split over (1: every device holds whole pages)."""
    spec = kv_cache_sharding(config, mesh, 1, 1).spec
    return mesh.shape[MODEL] if MODEL in tuple(spec) else 1


def attention_specs(config: ModelConfig, mesh: Mesh) -> tuple[PartitionSpec, PartitionSpec]:
    """shard_map specs of attention: (q/k/v [T, heads, D], KV cache). With KV heads split, each
    device attends its own query heads over its own KV heads (a contiguous split keeps every query
    head beside its KV head); otherwise attention runs whole on every device of the group."""
    cache = kv_cache_sharding(config, mesh, 1, 1).spec
    return (PartitionSpec(None, MODEL, None) if MODEL in tuple(cache) else PartitionSpec()), cache


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE) that the decoder's block runs in place of its
dense MLP (jaxserve.executor.models.decoder; ModelConfig.num_experts and friends say when).

Dropless: every token goes to its top-k experts, whatever their load. The token copies are sorted
by expert and each expert's rows run through one grouped matmul (row group e times expert e's
weights), so there is no capacity factor and no token is ever dropped; the results go back to
token order and are summed with the router's weights. The router (logits, softmax, top-k,
renormalization) runs in f32 whatever the model's dtype. The grouped matmul is
`jax.lax.ragged_dot` on GPU and TPU (XLA's own). On the CPU, whose lowering of it multiplies every
row by every expert (E times the work: 100-500x a dense MLP of the active width on a Qwen3-30B-A3B
shape), the C++ grouped-matmul kernel (jaxserve.kernels.grouped_matmul: one call per projection,
each expert present read once where it lies in the sparse layers' stack) runs where the CPU
kernels do and takes the weights (`experts_in_place`); elsewhere a loop over tiles of rows of one
expert each (`tiled_grouped_mlp`) does the work of the rows present, padded to a tile per expert.

Parameters, outside the decoder's per-layer stacks because a model may mix dense and sparse layers
(Qwen3-MoE's mlp_only_layers): `moe/router` [S, H, E], `moe/{gate,up}_proj` [S, E, H, I],
`moe/down_proj` [S, E, I, H] for the S sparse layers (ModelConfig.sparse_layers, in order) (with
config.moe_bias, gpt-oss's biases: `moe/router_bias` [S, E], `moe/{gate,up}_bias` [S, E, I],
`moe/down_bias` [S, E, H]), and
`dense_mlp/{gate,up,down}_proj` [D, H, I'] / [D, I', H] for the D dense ones, if any. The `expert`
logical axis is sharded by expert parallelism (ModelConfig.expert_parallel: `expert_parallel`
dispatches the tokens); without it each expert's `mlp` axis shards under tensor parallelism as a
dense MLP's does. A layer of the scan picks its slice of either stack by its layer id (`layer_mlp`).
"""

from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.executor import sharding
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels import grouped_matmul as cpu_grouped

Activation = Callable[[jax.Array], jax.Array]
Glu = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> the experts' hidden units

# Logical axis names of each parameter (see the module docstring).
AXES = {
    # The router's columns (and its per-expert biases) are "router": every device routes every
    # token, also under expert parallelism, which shards the "expert" axis.
    "moe": {"router": ("layers", "embed", "router"),
            "gate_proj": ("layers", "expert", "embed", "mlp"),
            "up_proj": ("layers", "expert", "embed", "mlp"),
            "down_proj": ("layers", "expert", "mlp", "embed"),
            "router_bias": ("layers", "router"), "gate_bias": ("layers", "expert", "mlp"),
            "up_bias": ("layers", "expert", "mlp"), "down_bias": ("layers", "expert", "embed")},
    "dense_mlp": {"gate_proj": ("layers", "embed", "mlp"), "up_proj": ("layers", "embed", "mlp"),
                  "down_proj": ("layers", "mlp", "embed")},
}
AXES["moe"]["score_correction_bias"] = ("layers", "router")  # DeepSeek-V3 (`grouped_route`)
AXES["shared_mlp"] = AXES["dense_mlp"]  # DeepSeek-V3's shared experts, one MLP per sparse layer


def param_shapes(config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Shape of each MoE-model MLP parameter (the `dense_mlp` group only with dense layers)."""
    c = config
    S, D, H, E = len(c.sparse_layers), len(c.dense_layers), c.hidden_size, c.num_experts
    I, Id = c.moe_intermediate_size, c.intermediate_size
    out = {"moe": {"router": (S, H, E), "gate_proj": (S, E, H, I), "up_proj": (S, E, H, I),
                   "down_proj": (S, E, I, H)}}
    if c.moe_bias:
        out["moe"].update(router_bias=(S, E), gate_bias=(S, E, I), up_bias=(S, E, I),
                          down_bias=(S, E, H))
    if c.moe_scoring == "sigmoid":
        out["moe"]["score_correction_bias"] = (S, E)
    if c.num_shared_experts:
        Is = I * c.num_shared_experts  # HF runs the shared experts as one MLP this wide
        out["shared_mlp"] = {"gate_proj": (S, H, Is), "up_proj": (S, H, Is),
                             "down_proj": (S, Is, H)}
    if D:
        out["dense_mlp"] = {"gate_proj": (D, H, Id), "up_proj": (D, H, Id),
                            "down_proj": (D, Id, H)}
    return out


def boxed_init(config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters (unit-scale activations, as the decoder's) with their logical axes."""
    shapes = param_shapes(config)
    keys = iter(jax.random.split(rng, sum(len(g) for g in shapes.values())))
    out = {}
    for group, params in shapes.items():
        out[group] = {}
        for name, shape in params.items():
            # Every weight here is [..., in, out]; biases as large as typical activations' tenth.
            scale = 0.1 if name.endswith("_bias") else shape[-2] ** -0.5
            dt = jnp.dtype(config.param_dtype(group, name))  # the experts' maybe bf16
            w = jax.random.normal(next(keys), shape, dt) * scale
            out[group][name] = nn.Partitioned(w, names=AXES[group][name])
    return out


def route(x: jax.Array, router: jax.Array, k: int, norm_topk_prob: bool,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts [T, k] and their weights [T, k] (f32): the softmax over all
    experts' logits (plus `bias`: gpt-oss), taken at the k largest, renormalized to sum 1 if
    norm_topk_prob (then equal to gpt-oss's softmax over the k largest logits)."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts, weights


def grouped_route(x: jax.Array, router: jax.Array, correction_bias: jax.Array,
                  config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router (HF's DeepseekV3TopkRouter), in f32: sigmoid scores; the experts
    chosen by score + correction_bias [E], only among the moe_topk_groups groups (of
    moe_num_groups, consecutive experts) whose best two such values sum highest; weighted by their
    plain scores, renormalized if norm_topk_prob, times routed_scaling_factor."""
    c = config
    T, E, G = x.shape[0], c.num_experts, c.moe_num_groups
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction_bias.astype(jnp.float32)
    if c.moe_topk_groups < G:
        group_scores = jax.lax.top_k(choice.reshape(T, G, E // G), 2)[0].sum(-1)
        _, groups = jax.lax.top_k(group_scores, c.moe_topk_groups)
        keep = jax.nn.one_hot(groups, G, dtype=jnp.bool_).any(axis=1)  # [T, G]
        choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, c.experts_per_token)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * c.routed_scaling_factor


def routing(x: jax.Array, p: dict, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The family's router on x [T, H] with one layer's `moe` params: (experts, weights) [T, k]."""
    if config.moe_scoring == "sigmoid":
        return grouped_route(x, p["router"], p["score_correction_bias"], config)
    return route(x, p["router"], config.experts_per_token, config.norm_topk_prob,
                 p.get("router_bias"))


def experts_mlp(x: jax.Array, p: dict, config: ModelConfig, activation: Activation,
                precision: jax.lax.Precision, num_local: int | None = None,
                layer: jax.Array | None = None) -> jax.Array:
    """x [T, H] through its top-k experts (one layer's `moe` parameters), dropless: [T, H].
    num_local: expert parallelism (inside `expert_parallel`'s shard_map): `p` holds this
    device's num_local experts, the copies routed to other devices' experts are theirs, and the
    devices' partial sums are added. layer: where `experts_in_place`, `p` holds every sparse
    layer's parameters ([S, ...]) and `layer` indexes them; the CPU kernel reads the experts'
    weights there (a slice would copy the layer's experts out of the stack first)."""
    c = config
    stacks = p
    if layer is not None:  # the router and biases are small: sliced as usual
        p = {name: w[layer] for name, w in stacks.items() if not name.endswith("_proj")}
    T, k = x.shape[0], c.experts_per_token
    experts, weights = routing(x, p, c)
    num_groups = c.num_experts
    if num_local is not None:
        # Other devices' experts -> group num_local: sorted last, never computed, weight 0.
        first = jax.lax.axis_index(sharding.MODEL) * num_local
        here = (experts >= first) & (experts < first + num_local)
        experts, weights = jnp.where(here, experts - first, num_local), jnp.where(here, weights, 0)
        num_groups = num_local
    flat = experts.reshape(-1)  # token t's j-th choice at row t * k + j
    order = jnp.argsort(flat, stable=True)  # the T * k copies grouped by expert
    group_sizes = jnp.bincount(flat, length=num_groups).astype(jnp.int32)
    rows = jnp.take(x, order // k, axis=0)

    if layer is not None:
        out = kernel_grouped_mlp(rows, group_sizes, p, gated(c, activation), stacks, layer)
    else:
        args = (group_sizes, p, gated(c, activation), precision)
        out = jax.lax.platform_dependent(rows, cpu=lambda r: tiled_grouped_mlp(r, *args),
                                         default=lambda r: ragged_grouped_mlp(r, *args))
    # Back to token order (a gather, not a scatter-add: deterministic) and weighted per choice.
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(T, k, -1)
    out = jnp.einsum("tkh,tk->th", out.astype(jnp.float32), weights)
    if num_local is not None:
        out = jax.lax.psum(out, sharding.MODEL)  # in f32, then rounded once
    return out.astype(x.dtype)


def expert_parallel(config: ModelConfig, mesh: jax.sharding.Mesh, activation: Activation,
                    precision: jax.lax.Precision) -> Callable[[jax.Array, dict], jax.Array]:
    """`experts_mlp` with the experts sharded over the mesh's model axis (expert parallelism):
    (x [T, H], one layer's `moe` params as placed by EXPERT_PARALLEL_RULES) -> [T, H].

    Dispatch and combine, explicitly (shard_map): every device holds every token (x is
    replicated, as after tensor-parallel attention) and the router, so each routes them all and
    picks the copies bound for its own E / n experts, which run through its grouped matmul as
    on one device (dropless); the combine is one psum of the [T, H] partial outputs in f32, the
    all-reduce a tensor-parallel MLP ends with. An all-to-all would send each copy to its expert
    and back (2 T k H elements in all); with the tokens already everywhere, the psum moves
    about 2 T H per device and nothing before the experts."""
    rules, n = sharding.EXPERT_PARALLEL_RULES, mesh.shape[sharding.MODEL]
    local = functools.partial(experts_mlp, config=config, activation=activation,
                              precision=precision, num_local=config.num_experts // n)

    def run(x: jax.Array, p: dict, layer: jax.Array | None = None) -> jax.Array:
        # p: one layer's parameters, or with `layer` every sparse layer's (experts_mlp's layer)
        lead = 1 if layer is None else 0
        specs = {name: sharding.mesh_spec(PartitionSpec(*AXES["moe"][name][lead:]), w.shape,
                                          mesh, rules) for name, w in p.items()}
        # (check_vma off: the CPU's tile loop carries per-device rows the checker cannot type.)
        return jax.shard_map(lambda x, p, layer: local(x, p, layer=layer), mesh=mesh,
                             in_specs=(PartitionSpec(), specs, PartitionSpec()),
                             out_specs=PartitionSpec(), check_vma=False)(x, p, layer)

    return run


def gated(config: ModelConfig, activation: Activation) -> Glu:
    """The experts' (gate, up) -> hidden units: activation(gate) * up, or gpt-oss's clamped
    SwiGLU (ModelConfig.swiglu_limit)."""
    if config.swiglu_limit is None:
        return lambda gate, up: activation(gate) * up
    return functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)


def clamped_swiglu(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's experts (HF's GptOssExperts._apply_gate)."""
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(gate * alpha)


def grouped_gated_mlp(rows: jax.Array, group_sizes: jax.Array, p: dict, glu: Glu,
                      product: Callable[[jax.Array, str], jax.Array]) -> jax.Array:
    """The experts' gated MLPs over `rows` [N, H] sorted by expert (group_sizes [E] of them),
    each projection `product(lhs, name)` (a grouped matmul); `{gate,up,down}_bias` (gpt-oss, in
    `p`) added by each row's expert."""
    expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                        total_repeat_length=rows.shape[0])

    def grouped(lhs, name):
        out = product(lhs, name)
        bias = p.get(f"{name}_bias")
        return out if bias is None else out + jnp.take(bias, expert, axis=0)

    return grouped(glu(grouped(rows, "gate"), grouped(rows, "up")), "down")


def ragged_grouped_mlp(rows: jax.Array, group_sizes: jax.Array, p: dict, glu: Glu,
                       precision: jax.lax.Precision) -> jax.Array:
    """`grouped_gated_mlp` through XLA's grouped matmul."""
    return grouped_gated_mlp(rows, group_sizes, p, glu, lambda lhs, name: jax.lax.ragged_dot(
        lhs, p[f"{name}_proj"].astype(lhs.dtype), group_sizes, precision=precision))


def kernel_grouped_mlp(rows: jax.Array, group_sizes: jax.Array, p: dict, glu: Glu,
                       stacks: dict, layer: jax.Array) -> jax.Array:
    """`grouped_gated_mlp` through the CPU kernel, which reads the projections of layer `layer`
    of the sparse layers' stacks ({gate,up,down}_proj [S, E, ...] in `stacks`) in place; rows
    past the groups (other devices' copies under expert parallelism, weighted 0) come out
    finite: the kernel writes them zeros."""
    return grouped_gated_mlp(rows, group_sizes, p, glu, lambda lhs, name: (
        cpu_grouped.grouped_matmul(lhs, stacks[f"{name}_proj"], layer, group_sizes)))


def experts_in_place(config: ModelConfig, mesh: jax.sharding.Mesh | None) -> bool:
    """Whether the experts run through the CPU grouped-matmul kernel (`kernel_grouped_mlp`):
    where the CPU kernels are enabled and take the experts' weights (a float32 model's, stored
    f32 or bf16: config.weight_dtype; widths a multiple of the kernel's vectors), on one device
    or per device under expert parallelism's shard_map —
    not where XLA shards the experts' MLPs itself (tensor parallel without expert parallelism)."""
    c = config
    shapes = [(c.hidden_size, c.moe_intermediate_size), (c.moe_intermediate_size, c.hidden_size)]
    sharded = mesh is not None and not _expert_parallel(c, mesh)
    return (not sharded and jnp.dtype(c.dtype) == jnp.float32
            and cpu_grouped.supports(shapes, c.param_dtype("moe", "gate_proj"))
            and cpu_kernels.enabled())


def _expert_parallel(config: ModelConfig, mesh: jax.sharding.Mesh | None) -> bool:
    return config.expert_parallel and mesh is not None and mesh.shape[sharding.MODEL] > 1


MAX_TILE = 16  # rows of one expert per step of the CPU's grouped matmul, at most


def tiled_grouped_mlp(rows: jax.Array, group_sizes: jax.Array, p: dict, glu: Glu,
                      precision: jax.lax.Precision) -> jax.Array:
    """`ragged_grouped_mlp`'s result by a loop over tiles of m rows of one expert, as many as
    the groups need (a static bound: N / m plus one partial tile per expert present). A tile's
    rows past its group are computed, then overwritten by the next group's tile, which comes
    later. m is the mean rows per expert (a power of two up to MAX_TILE): 1 when a decode step's
    few rows scatter."""
    n, num_groups = rows.shape[0], group_sizes.shape[0]
    m = int(min(MAX_TILE, 2 ** max(0, (n // num_groups).bit_length() - 1)))
    p = {name: jnp.asarray(w) for name, w in p.items()}
    tiles = (group_sizes + m - 1) // m
    tile_end = jnp.cumsum(tiles)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    j = jnp.arange(n // m + min(num_groups, n) + 1)
    expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), num_groups - 1)
    start = group_start[expert] + (j - (tile_end - tiles)[expert]) * m
    padded = jnp.concatenate([rows, jnp.zeros((m, rows.shape[1]), rows.dtype)])

    def tile(i, out):
        e, s = expert[i], start[i]

        def project(x, name):
            y = jnp.dot(x, p[f"{name}_proj"][e].astype(x.dtype), precision=precision)
            return y + p[f"{name}_bias"][e] if f"{name}_bias" in p else y

        x = jax.lax.dynamic_slice_in_dim(padded, s, m)
        h = glu(project(x, "gate"), project(x, "up"))
        return jax.lax.dynamic_update_slice_in_dim(out, project(h, "down").astype(out.dtype), s, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], tile, jnp.zeros_like(padded))
    return out[:n]


def dense_mlp(x: jax.Array, p: dict, activation: Activation,
              precision: jax.lax.Precision) -> jax.Array:
    """A dense layer's gated MLP in a mixture-of-experts model."""
    gate = jnp.dot(x, p["gate_proj"], precision=precision)
    up = jnp.dot(x, p["up_proj"], precision=precision)
    return jnp.dot(activation(gate) * up, p["down_proj"], precision=precision)


def layer_mlp(config: ModelConfig, params: dict, activation: Activation,
              precision: jax.lax.Precision, mesh: jax.sharding.Mesh | None = None
              ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """(h [T, H], layer id) -> the MLP of that layer, for the decoder's scan: its slice of the
    sparse layers' stack, or (lax.cond, only where the model has dense layers) of the dense
    ones'. With config.expert_parallel on a mesh, the experts run `expert_parallel`; where
    `experts_in_place`, they get the whole stacks and the layer's index."""
    c = config
    experts = functools.partial(experts_mlp, config=c, activation=activation, precision=precision)
    if _expert_parallel(c, mesh):
        experts = expert_parallel(c, mesh, activation, precision)
    in_place = experts_in_place(c, mesh)
    slot, is_sparse = layer_slots(c)

    def take(group, layer):
        i = jnp.asarray(slot)[layer]
        return jax.tree.map(lambda w: w[i], params[group])

    def sparse(h, layer):
        if in_place:
            out = experts(h, params["moe"], layer=jnp.asarray(slot)[layer])
        else:
            out = experts(h, take("moe", layer))
        if c.num_shared_experts:
            out = out + dense_mlp(h, take("shared_mlp", layer), activation, precision)
        return out

    def dense(h, layer):
        return dense_mlp(h, take("dense_mlp", layer), activation, precision)

    if not c.dense_layers:
        return sparse
    return lambda h, layer: jax.lax.cond(jnp.asarray(is_sparse)[layer], sparse, dense, h, layer)


def layer_slots(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: its index in its own stack (`moe` or `dense_mlp`), and whether it is sparse."""
    c = config
    slot = np.zeros(c.num_layers, np.int32)
    slot[list(c.sparse_layers)] = np.arange(len(c.sparse_layers))
    slot[list(c.dense_layers)] = np.arange(len(c.dense_layers))
    return slot, np.isin(np.arange(c.num_layers), c.sparse_layers)


def layer_expert_tokens(config: ModelConfig, params: dict,
                        valid: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """(h [T, H], layer id) -> how many of the step's tokens (valid [T]: not padding) the layer
    routes to each expert, i32 [E] (zeros for a dense layer): the load metric's counts
    (jaxserve:moe_expert_tokens). It routes again rather than changing the MLP's outputs: one
    T x H x E matmul and a top-k, which XLA shares with the MLP's own routing where both sit in
    one program (not under expert parallelism's shard_map: there it is under 1% of the layer)."""
    slot, is_sparse = layer_slots(config)

    def count(h: jax.Array, layer: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda w: w[jnp.asarray(slot)[layer]], params["moe"])
        experts, _ = routing(h, p, config)
        hits = jnp.broadcast_to((valid & jnp.asarray(is_sparse)[layer])[:, None], experts.shape)
        return jnp.zeros(config.num_experts, jnp.int32).at[experts].add(hits.astype(jnp.int32))

    return count

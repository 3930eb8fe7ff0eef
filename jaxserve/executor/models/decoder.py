"""The decoder of every supported family (Llama 2/3.x, Mistral, Qwen2/2.5/3, Gemma 2/3,
Phi-3/3.5/4-mini, SmolLM2; Mixtral and Qwen3-MoE, whose MLPs are jaxserve.executor.models.moe)
over a ragged token batch: one definition, the families' differences are ModelConfig fields
(see jaxserve.weights.architectures, which sets them per family).

The model is a pure function of (params, kv_cache, batch): `forward` runs every layer over the flat
tokens of one `BatchPlan` and returns the final-normed hidden states plus the updated KV cache;
`compute_logits` runs the LM head on the few rows that sample. `config` is a static, hashable
`ModelConfig`: callers jit with `functools.partial` or `static_argnums`.

Layout choices:
- One decoder block is a Flax linen module; the blocks' parameters are stacked on a leading axis
  and run with `jax.lax.scan`, so compile time does not grow with depth. (Not `nn.scan`: it traces
  the body once more to check broadcast invariants, which fails on Pallas GPU kernels with flax
  0.12.10 / JAX 0.11.) The parameter tree is flat and named after the HF checkpoint it comes from:
    embed_tokens [V, H], norm [H], lm_head [H, V] (only if untied),
    layers/{input_norm, post_attention_norm} [L, H] (before attention, before the MLP),
    layers/{attn_output_norm, mlp_output_norm} [L, H] (Gemma's sandwich norms),
    layers/{q_norm, k_norm} [L, D] (Qwen3, Gemma 3),
    layers/{q,k,v}_proj [L, H, heads, D], layers/{q,k,v}_bias [L, heads, D] (Qwen2),
    layers/o_proj [L, Hq, D, H], layers/{gate,up}_proj [L, H, I], layers/down_proj [L, I, H],
    layers/o_bias [L, H] and layers/sinks [L, Hq] (gpt-oss: o_proj's bias, attention sinks).
  Latent attention (config.mla: DeepSeek-V3) has jaxserve.executor.models.mla's parameters in
  place of layers/{q,k,v,o}_proj, and a cache of latent rows (`cache_shape`).
  A mixture of experts (config.num_experts) has no layers/{gate,up,down}_proj: its MLPs are the
  `moe` and `dense_mlp` groups of jaxserve.executor.models.moe, which the block calls.
  With config.quantization "gguf" the tensors of config.gguf_formats are the GGUF file's blocks as
  they are, uint8 [L, N, K / 32 * bytes] for a projection (N its flattened output axes, K its
  contraction axes) and [V, H / 32 * bytes] for embed_tokens / lm_head (jaxserve.weights.gguf);
  with "int8" the seven projections are blocks of that layout in the int8 storage's format
  (jaxserve.weights.quantize; `_block_format`, `_weight`).
  Every parameter carries logical axis names (`param_logical_axes`), which `param_shardings` maps
  to mesh axes through the rule table in jaxserve.executor.sharding.
- All layers share one KV cache array [L * num_pages, page_size, 2 * Hkv, D] that rides in the scan
  carry (updated in place when the caller donates it). Layer l's page p is row l * num_pages + p, so
  the model offsets the batch's page indices and slots per layer and the attention kernel sees a
  plain paged cache.
- Where the CPU kernels are enabled (jaxserve.kernels.cpu), steps of jaxserve.kernels.matmul's
  MIN_ROWS to MAX_ROWS tokens keep the seven projection weights out of the scan: the kernel reads
  layer `layer` of each stack in place, where the scan would copy each layer's slice out first
  (see `_projections_in_place`; `why_matmul_off` says why a model never does). GGUF blocks are
  read in place by the quantized kernel in steps of up to QUANTIZED_MAX_ROWS tokens (one token
  included) and for the LM head's rows, and so are the int8 storage's; larger steps dequantize
  each layer inside the step.
- RoPE uses the HF "rotate half" convention; the GGUF loader undoes llama.cpp's interleaved layout.
  Fused checkpoints (Phi-3's qkv_proj and gate_up_proj) are split by the loader, so tensor
  parallelism shards them like any other family.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.executor import sharding
from jaxserve.executor.batch_plan import BatchPlan
from jaxserve.executor.models import mla, moe
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.kernels import attention as rpa
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels import matmul as cpu_matmul
from jaxserve.shapes import kv_cache_shape, mla_cache_shape


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
           init) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _fan_in_normal(fan_in: int):
    # Unit-scale activations in random models, so tests of tiny models see real signal.
    return nn.initializers.normal(stddev=fan_in ** -0.5)


# The decoder layer's projection weights and how many of their leading axes contract (the rest
# are output axes): what int8 storage quantizes, per group of contraction rows.
PROJECTIONS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1,
               "down_proj": 1}


def _block_format(config: ModelConfig, name: str) -> str | None:
    """The block format `name` is kept in (jaxserve.kernels.matmul FORMATS): quantization "gguf"
    as config.gguf_formats says, "int8" for the layers' projections; or None."""
    if config.quantization == "int8":
        return "int8" if name in PROJECTIONS else None
    return dict(config.gguf_formats).get(name)


def _blocks(module: nn.Module, name: str, rows: int, k: int, fmt: str, scale: float) -> jax.Array:
    """A tensor kept as blocks (GGUF's or int8's): uint8 [rows, k / 32 * bytes] (random ones for
    tests)."""
    return _param(module, name, (rows, cpu_matmul.row_bytes(fmt, k)),
                  ("quant_rows", "quant_bytes"), jnp.uint8,
                  lambda key, shape, dtype: cpu_matmul.random_blocks(key, rows, k, fmt, scale))


def _weight(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
            init) -> jax.Array:
    """A projection weight (its first PROJECTIONS[name] axes contract), stored in
    config.param_dtype (bf16 where config.weight_dtype says: widened where it is used), or kept
    as blocks (`_block_format`: GGUF's, or the int8 storage's, jaxserve.weights.quantize)
    [N, K / 32 * bytes] and dequantized here, inside the step, so only the blocks are read from
    memory (XLA:CPU writes the dequantized layer to a buffer the dot reads: it fits in cache)."""
    c = module.config
    fmt = _block_format(c, name)
    if fmt is None:
        return _param(module, name, shape, axes, jnp.dtype(c.param_dtype("layers", name)), init)
    num_contract = PROJECTIONS[name]
    k = math.prod(shape[:num_contract])
    w = _blocks(module, name, math.prod(shape[num_contract:]), k, fmt, 3 * k ** -0.5)
    return cpu_matmul.dequantize(w, fmt).T.reshape(shape).astype(c.dtype)


def why_matmul_off(config: ModelConfig, mesh: jax.sharding.Mesh | None) -> str | None:
    """Why this model's projections never go through the CPU matmul kernel whatever the CPU
    kernels' switch (tensor parallel, bf16, shapes it does not take), or None."""
    c = config
    if mesh is not None:
        return "tensor parallel"
    if c.mla is not None:
        return "latent attention"
    if jnp.dtype(c.dtype) != jnp.float32:
        return f"{c.dtype} weights (the kernel takes float32)"
    if _block_format(c, "q_proj") is not None:
        return None  # the quantized kernel (GGUF or int8 blocks): any output width
    if not cpu_matmul.supports(cpu_matmul.MIN_ROWS, _projection_shapes(c),
                               c.param_dtype("layers", "q_proj")):
        return f"output widths not a multiple of {cpu_matmul.COLUMN_MULTIPLE}"
    return None


def _projection_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """The (K, N) of the layers' projections (a mixture's MLP is the experts': moe.py's)."""
    H, I, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, \
        c.num_kv_heads * c.head_dim
    return [(H, q), (H, kv), (q, H)] + ([] if c.num_experts else [(H, I), (I, H)])


def _projections_in_place(config: ModelConfig, mesh: jax.sharding.Mesh | None,
                          num_tokens: int) -> bool:
    """Whether a step of `num_tokens` reads the projection weights in place from the layers'
    stack through the CPU kernel (jaxserve.kernels.matmul) instead of a slice per layer."""
    if _block_format(config, "q_proj") is not None:
        return (why_matmul_off(config, mesh) is None and cpu_kernels.enabled()
                and num_tokens <= cpu_matmul.QUANTIZED_MAX_ROWS)
    return (why_matmul_off(config, mesh) is None and cpu_kernels.enabled()
            and cpu_matmul.supports(num_tokens, _projection_shapes(config),
                                    config.param_dtype("layers", "q_proj")))


def _project(x: jax.Array, w: jax.Array, num_contract: int, layer: jax.Array, in_place: bool,
             precision: jax.lax.Precision, shape: tuple[int, ...], fmt: str | None,
             int8_dot: bool = False) -> jax.Array:
    """x [T, *K] @ w [*K, *N] -> [T, *N] (K: the first num_contract axes of the weight's
    `shape`). `in_place`: w is the stack of all layers' weights [L, *K, *N], or with `fmt` their
    blocks [L, N, bytes] (`int8_dot`: config.gguf_dot "int8"), and `layer` picks one, read
    where it lies. Weights stored in bf16
    for a float32 model (config.weight_dtype) are widened here, exactly, off the kernel."""
    if not in_place:
        return jnp.tensordot(x, w.astype(x.dtype), num_contract, precision=precision)
    if fmt is not None:
        out = cpu_matmul.quantized_matmul(x.reshape(x.shape[0], -1), w, layer, fmt, int8_dot)
        return out.reshape(x.shape[0], *shape[num_contract:])
    k_shape, n_shape = w.shape[1:1 + num_contract], w.shape[1 + num_contract:]
    out = cpu_matmul.stacked_matmul(x.reshape(x.shape[0], math.prod(k_shape)),
                                    w.reshape(w.shape[0], math.prod(k_shape), -1), layer)
    return out.reshape(x.shape[0], *n_shape)


def _project_together(x: jax.Array, ws: list[jax.Array], num_contract: int, layer: jax.Array,
                      in_place: bool, precision: jax.lax.Precision,
                      shapes: list[tuple[int, ...]], fmts: list[str | None],
                      int8_dot: bool = False) -> list[jax.Array]:
    """`_project` of x through several weights (a layer's q, k, v or gate, up). GGUF blocks of
    one format in place: one kernel call over all of them (one wake-up of the threads instead of
    one per weight: at one row a call's own cost is a good part of a small projection's)."""
    if not (in_place and fmts[0] is not None and len(set(fmts)) == 1):
        return [_project(x, w, num_contract, layer, in_place, precision, shape, fmt, int8_dot)
                for w, shape, fmt in zip(ws, shapes, fmts)]
    out = cpu_matmul.quantized_matmul(x.reshape(x.shape[0], -1), ws, layer, fmts[0], int8_dot)
    ends = np.cumsum([w.shape[1] for w in ws])[:-1]
    return [part.reshape(x.shape[0], *shape[num_contract:])
            for part, shape in zip(jnp.split(out, ends, axis=1), shapes)]


def _precision(config: ModelConfig) -> jax.lax.Precision:
    # float32 means float32: GPUs default f32 matmuls to TF32 and TPUs to one bf16 pass, which moves
    # logits by ~1e-3 relative and breaks the golden comparison. bf16 models are unaffected.
    return (jax.lax.Precision.HIGHEST if config.dtype == "float32" else jax.lax.Precision.DEFAULT)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm scaled by (offset + scale). Llama-style (offset 0) casts back before the scale, as
    HF does, so bf16 matches its rounding; Gemma's (1 + w) scales in f32 and casts after."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * xf.astype(x.dtype)


def rope_frequencies(theta: float, scaling: RopeScaling | None, rotary_dim: int) -> np.ndarray:
    """Inverse frequencies [2, rotary_dim / 2] (host constant): row 0 for positions below the
    original context, row 1 past it. They differ only for longrope; every other scaling is one
    set of frequencies for all positions."""
    d = rotary_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = scaling
    if rs is None:
        out = (inv_freq, inv_freq)
    elif rs.rope_type == "linear":
        out = (inv_freq / rs.factor,) * 2
    elif rs.rope_type == "longrope":
        out = (inv_freq / np.asarray(rs.short_factor), inv_freq / np.asarray(rs.long_factor))
    elif rs.rope_type == "yarn":
        # HF's _compute_yarn_parameters: interpolated (/ factor) below the dims that rotate
        # beta_slow times over the original context, kept above those that rotate beta_fast
        # times, a linear ramp between.
        def dim_of(rotations):
            return d * math.log(rs.original_max_position_embeddings
                                / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        ramp = np.clip((np.arange(d // 2) - low) / ((high - low) or 0.001), 0, 1)
        out = ((inv_freq / rs.factor) * ramp + inv_freq * (1 - ramp),) * 2
    else:
        # Llama 3: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
                  / (rs.high_freq_factor - rs.low_freq_factor))
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        out = (np.where(medium, blended, scaled),) * 2
    return np.stack(out).astype(np.float32)


def layer_rope_frequencies(config: ModelConfig) -> np.ndarray:
    """[L, 2, rotary_dim / 2]: each layer's `rope_frequencies` (Gemma 3's sliding layers use
    their own unscaled base)."""
    c = config
    rotary_dim = c.rotary_dim or c.head_dim
    full = rope_frequencies(c.rope_theta, c.rope_scaling, rotary_dim)
    local = (full if c.local_rope_theta is None
             else rope_frequencies(c.local_rope_theta, None, rotary_dim))
    return np.stack([full if w is None else local for w in c.layer_windows])


class RopeTables(NamedTuple):
    """cos and sin [S, T, rotary_dim / 2] of a step's positions for each of the S distinct
    frequency sets of `layer_rope_frequencies` (longrope's row picked per token, its or yarn's
    attention_factor applied), and each layer's set (host constant [L])."""
    cos: jax.Array
    sin: jax.Array
    layer_set: np.ndarray

    def of_layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The layer's cos and sin [T, rotary_dim / 2]."""
        if self.cos.shape[0] == 1:
            return self.cos[0], self.sin[0]
        s = jnp.asarray(self.layer_set)[layer]
        return self.cos[s], self.sin[s]


def rope_tables(config: ModelConfig, positions: jax.Array) -> RopeTables:
    """The step's `RopeTables`, computed once, outside the layers' scan: inside it XLA:CPU fused
    cos and sin into each layer's rotation and evaluated them again for every head's element
    (~9% of a 64-row decode step of SmolLM2)."""
    rs = config.rope_scaling
    sets, layer_set = np.unique(layer_rope_frequencies(config), axis=0, return_inverse=True)
    freqs = jnp.asarray(sets[:, 0])[:, None, :]
    mscale = 1.0
    if rs is not None and rs.rope_type == "longrope":
        past = positions >= rs.original_max_position_embeddings
        freqs = jnp.where(past[None, :, None], jnp.asarray(sets[:, 1])[:, None, :], freqs)
        mscale = rs.attention_factor
    elif rs is not None and rs.rope_type == "yarn":
        mscale = rs.attention_factor
    angles = positions.astype(jnp.float32)[None, :, None] * freqs
    return RopeTables(jnp.cos(angles) * mscale, jnp.sin(angles) * mscale, layer_set.reshape(-1))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D] rotated by position (rotate-half convention) on its first rotary_dim
    dims, by the layer's cos and sin [T, rotary_dim / 2] (`RopeTables.of_layer`). Longrope's
    tables pick the row per token, so a cached key keeps the rotation it was written with (as
    HF's decode does)."""
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    rot, rest = jnp.split(x, [2 * cos.shape[-1]], axis=-1)
    x1, x2 = jnp.split(rot, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def paged_attention(config: ModelConfig, mesh: jax.sharding.Mesh | None, q, k, v, kv_cache,
                    batch: BatchPlan, layer: jax.Array, sinks: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Store this step's K/V in the layer's pages and attend over them: (out [T, Hq, D], cache).
    `sinks` [Hq]: the layer's attention sinks (gpt-oss), or None.

    The kernels take the sliding window as a static argument: where layers differ (Gemma's
    alternation) the layer id picks one compiled call per distinct window (lax.switch), so only
    the layer's own window runs.
    Under a mesh the kernels run per device (shard_map) on that device's KV heads: they are
    custom calls XLA cannot partition, and partitioned any other way the cache would be gathered.
    """
    c = config
    windows = c.layer_windows
    distinct = sorted(set(windows), key=lambda w: -1 if w is None else w)
    which = np.asarray([distinct.index(w) for w in windows], np.int32)
    sm_scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5

    def attend(q, k, v, kv_cache, batch, layer, sinks):
        num_pages = kv_cache.shape[0] // c.num_layers
        page_size = kv_cache.shape[1]
        kv_cache = rpa.write_kv(kv_cache, k, v, batch.slot_mapping + layer * (num_pages * page_size))
        args = (q, kv_cache, batch.kv_lens, batch.page_indices + layer * num_pages,
                batch.cu_q_lens, batch.num_seqs)
        calls = [functools.partial(rpa.ragged_paged_attention, sm_scale=sm_scale,
                                   sliding_window=w, soft_cap=c.attn_logit_softcap, sinks=sinks)
                 for w in distinct]
        if len(calls) == 1:
            return calls[0](*args), kv_cache
        return jax.lax.switch(jnp.asarray(which)[layer], calls, *args), kv_cache

    if mesh is None:
        return attend(q, k, v, kv_cache, batch, layer, sinks)
    heads, cache = sharding.attention_specs(config, mesh)
    replicated = jax.sharding.PartitionSpec()
    sink_heads = jax.sharding.PartitionSpec(*heads[1:2])  # [Hq]: split as q's heads are
    # check_vma off: the kernels' outputs carry no varying-axes annotations for JAX to check.
    return jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, heads, cache, replicated,
                                                      replicated, sink_heads),
                         out_specs=(heads, cache), check_vma=False)(q, k, v, kv_cache, batch, layer,
                                                                    sinks)


_ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class DecoderLayer(nn.Module):
    """One pre-norm block: attention over the paged cache, then a gated MLP. Family differences
    are config: q/k norms (Qwen3, Gemma 3), sandwich norms and (1 + w) norms (Gemma), the MLP's
    activation, the attention's scale, window and soft cap."""

    config: ModelConfig
    mesh: jax.sharding.Mesh | None = None  # tensor parallel: attention runs per device

    @nn.compact
    def __call__(self, carry, layer: jax.Array, batch: BatchPlan, rope: RopeTables,
                 stacked_projections: dict | None = None, moe_mlp=None, moe_counts=None):
        """`rope`: the step's rotations (`rope_tables`). `stacked_projections`: the projection
        weights of all layers ([L, ...] each, not in this layer's params; a mixture's four of
        attention), read in place by the CPU kernel (`_projections_in_place`).
        `moe_mlp`: with config.num_experts, (h, layer) -> the layer's MLP (moe.layer_mlp), whose
        weights are not in the layer's params. `moe_counts`: (h, layer) -> the tokens it routes
        to each expert (moe.layer_expert_tokens), the layer's scan output; None: no output."""
        x, kv_cache = carry
        c = self.config
        dt = jnp.dtype(c.dtype)
        if c.mla is not None:
            return self._latent_layer(x, kv_cache, layer, batch, rope, moe_mlp), None
        H, Hq, Hkv, D, I = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size

        def weight(name, shape, axes, fan_in):
            if stacked_projections is not None:
                return stacked_projections[name]
            return _weight(self, name, shape, axes, _fan_in_normal(fan_in))

        def project(x, w, name, shape):
            return _project(x, w, PROJECTIONS[name], layer, stacked_projections is not None,
                            _precision(c), shape, _block_format(c, name), c.gguf_dot == "int8")

        def project_together(x, ws, names, shapes):
            return _project_together(x, ws, PROJECTIONS[names[0]], layer,
                                     stacked_projections is not None, _precision(c), shapes,
                                     [_block_format(c, name) for name in names],
                                     c.gguf_dot == "int8")

        def norm(name, x, size=H, axis="embed"):
            # Stored as HF stores it: Gemma's (1 + w) norms start from w = 0.
            init = nn.initializers.constant(1.0 - c.norm_offset)
            return rms_norm(x, _param(self, name, (size,), (axis,), dt, init), c.rms_norm_eps,
                            c.norm_offset)

        h = norm("input_norm", x)
        wq = weight("q_proj", (H, Hq, D), ("embed", "heads", "head_dim"), H)
        wk = weight("k_proj", (H, Hkv, D), ("embed", "kv_heads", "head_dim"), H)
        wv = weight("v_proj", (H, Hkv, D), ("embed", "kv_heads", "head_dim"), H)
        q, k, v = project_together(h, [wq, wk, wv], ["q_proj", "k_proj", "v_proj"],
                                   [(H, Hq, D), (H, Hkv, D), (H, Hkv, D)])
        if c.attention_bias:
            # Random biases larger than typical so a test of a tiny model notices a dropped bias.
            bias_init = nn.initializers.normal(stddev=0.1)
            q = q + _param(self, "q_bias", (Hq, D), ("heads", "head_dim"), dt, bias_init)
            k = k + _param(self, "k_bias", (Hkv, D), ("kv_heads", "head_dim"), dt, bias_init)
            v = v + _param(self, "v_bias", (Hkv, D), ("kv_heads", "head_dim"), dt, bias_init)
        if c.qk_norm:
            q = norm("q_norm", q, D, "head_dim")
            k = norm("k_norm", k, D, "head_dim")
        cos, sin = rope.of_layer(layer)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        sinks = (_param(self, "sinks", (Hq,), ("heads",), dt, nn.initializers.normal(stddev=1.0))
                 if c.attention_sinks else None)
        if self.is_initializing():
            # Creating parameters needs only shapes: keep init (and eval_shape of the param tree)
            # independent of the attention backend.
            attn = q
        else:
            attn, kv_cache = paged_attention(c, self.mesh, q, k, v, kv_cache, batch, layer, sinks)
        wo = weight("o_proj", (Hq, D, H), ("heads", "head_dim", "embed"), Hq * D)
        h = project(attn.astype(dt), wo, "o_proj", (Hq, D, H))
        if c.o_proj_bias:
            h = h + _param(self, "o_bias", (H,), ("embed",), dt, nn.initializers.normal(stddev=0.1))
        if c.sandwich_norms:
            h = norm("attn_output_norm", h)
        x = x + h

        # Named after HF's Llama (post_attention_layernorm): the norm before the MLP.
        h = norm("post_attention_norm", x)
        expert_tokens = moe_counts(h, layer) if moe_counts is not None else None
        if c.num_experts:
            h = moe_mlp(h, layer)
        else:
            w_gate = weight("gate_proj", (H, I), ("embed", "mlp"), H)
            w_up = weight("up_proj", (H, I), ("embed", "mlp"), H)
            w_down = weight("down_proj", (I, H), ("mlp", "embed"), I)
            gate, up = project_together(h, [w_gate, w_up], ["gate_proj", "up_proj"],
                                        [(H, I), (H, I)])
            mlp = _ACTIVATIONS[c.hidden_act](gate) * up
            h = project(mlp, w_down, "down_proj", (I, H))
        if c.sandwich_norms:
            h = norm("mlp_output_norm", h)
        x = x + h
        return (x, kv_cache), expert_tokens


    def _latent_layer(self, x, kv_cache, layer, batch: BatchPlan, rope: RopeTables, moe_mlp):
        """A DeepSeek-V3 block: latent attention over the latent cache
        (jaxserve.executor.models.mla), then the layer's MLP (dense or experts: moe_mlp)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        ones = nn.initializers.ones

        def norm(name):
            return _param(self, name, (c.hidden_size,), ("embed",), dt, ones)

        p = {name: _param(self, name, shape, axes, dt, _fan_in_normal(fan_in) if fan_in else ones)
             for name, (shape, axes, fan_in) in mla.param_specs(c).items()}
        cos, sin = rope.of_layer(layer)
        h, kv_cache = mla.attention(
            c, self.mesh, p, rms_norm(x, norm("input_norm"), c.rms_norm_eps), layer, batch,
            kv_cache, norm=lambda v, w: rms_norm(v, w, mla.LATENT_NORM_EPS),
            rope=lambda v: apply_rope(v, cos, sin), precision=_precision(c),
            initializing=self.is_initializing())
        x = x + h
        return x + moe_mlp(rms_norm(x, norm("post_attention_norm"), c.rms_norm_eps), layer), \
            kv_cache


def cache_shape(config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The KV pool's array for this model: the standard layout, or latent attention's rows."""
    c = config
    if c.mla is not None:
        return mla_cache_shape(num_pages, page_size, c.mla.latent_dim, c.num_layers)
    return kv_cache_shape(num_pages, page_size, c.num_kv_heads, c.head_dim, c.num_layers)


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=None) -> jax.Array:
    """Zeroed cache for all layers (`cache_shape`): [L * num_pages, page_size, 2 * Hkv, D] with K
    in even slots and V in odd ones, or latent attention's [L * num_pages, page_size, latent]."""
    return jnp.zeros(cache_shape(config, num_pages, page_size), jnp.dtype(dtype or config.dtype))


def _init_batch() -> BatchPlan:
    """The smallest valid batch (one padding token, one empty sequence), only to trace init."""
    z = jnp.zeros((1,), jnp.int32)
    return BatchPlan(token_ids=z, positions=z, slot_mapping=z, cu_q_lens=jnp.zeros((2,), jnp.int32),
                     kv_lens=z, page_indices=jnp.zeros((1, 1), jnp.int32), num_seqs=z,
                     logits_indices=z)


def _boxed_init(config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters boxed with their logical axis names (nn.Partitioned)."""
    c = config
    dt = jnp.dtype(c.dtype)
    k_embed, k_head, k_layers = jax.random.split(rng, 3)
    carry = (jnp.zeros((1, c.hidden_size), dt), init_kv_cache(c, num_pages=1, page_size=1))
    layer = DecoderLayer(c)
    batch = _init_batch()
    layers = jax.vmap(lambda k: layer.init(k, carry, jnp.int32(0), batch,
                                           rope_tables(c, batch.positions), None,
                                           lambda h, layer: h)["params"])(
        jax.random.split(k_layers, c.num_layers))
    params = {
        "embed_tokens": _vocab_param(c, "embed_tokens", k_embed, nn.Partitioned(
            nn.initializers.normal(stddev=1.0)(k_embed, (c.vocab_size, c.hidden_size), dt),
            names=("vocab", "embed"))),
        "norm": nn.Partitioned(jnp.full((c.hidden_size,), 1.0 - c.norm_offset, dt),
                               names=("embed",)),
        "layers": nn.meta.add_axis(layers, 0, {nn.PARTITION_NAME: "layers"}),
        **(moe.boxed_init(c, jax.random.fold_in(rng, 1)) if c.num_experts else {}),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = _vocab_param(c, "lm_head", k_head, nn.Partitioned(
            _fan_in_normal(c.hidden_size)(k_head, (c.hidden_size, c.vocab_size), dt),
            names=("embed", "vocab")))
    return params


def _vocab_param(config: ModelConfig, name: str, key: jax.Array, dense):
    """embed_tokens / lm_head: `dense`, or random GGUF blocks [V, H / 32 * bytes] where the
    config keeps it as blocks."""
    fmt = _block_format(config, name)
    if fmt is None:
        return dense
    scale = 1.0 if name == "embed_tokens" else 3 * config.hidden_size ** -0.5
    return nn.Partitioned(cpu_matmul.random_blocks(key, config.vocab_size, config.hidden_size,
                                                   fmt, scale), names=("quant_rows", "quant_bytes"))


_jit_boxed_init = jax.jit(_boxed_init, static_argnums=0)


def init_params(config: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters (for tiny test models); same tree as the weight loaders produce."""
    return nn.unbox(_jit_boxed_init(config, rng))


def param_logical_axes(config: ModelConfig) -> dict:
    """PartitionSpec of logical axis names for every parameter (no arrays are allocated)."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0))
    return nn.get_partition_spec(boxed)


def param_shapes(config: ModelConfig) -> dict:
    """ShapeDtypeStruct of every parameter: what a loader must produce."""
    return nn.unbox(jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0)))


def param_shardings(config: ModelConfig, mesh: jax.sharding.Mesh) -> dict:
    """NamedSharding of every parameter on `mesh` (tensor parallel): the logical axes declared
    here, mapped to mesh axes by the rule table in jaxserve.executor.sharding."""
    return sharding.named_shardings(param_logical_axes(config), param_shapes(config), mesh,
                                    sharding.axis_rules(config))


def forward(params: dict, config: ModelConfig, kv_cache: jax.Array, batch: BatchPlan,
            mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Run all layers over the batch's flat tokens: (final-normed hidden [T, H], kv_cache).
    With `mesh` (params and cache sharded by jaxserve.executor.sharding), attention runs per
    device."""
    return _layers(params, config, kv_cache, batch, mesh, count_experts=False)[:2]


def forward_with_expert_tokens(params: dict, config: ModelConfig, kv_cache: jax.Array,
                               batch: BatchPlan, mesh: jax.sharding.Mesh | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`forward` of a mixture of experts, plus the step's tokens routed to each expert summed
    over its layers, i32 [E] (padding not counted; [0] where the layers do not count, as
    latent attention's do not yet): what the load metric reads."""
    hidden, kv_cache, counts = _layers(params, config, kv_cache, batch, mesh, count_experts=True)
    return hidden, kv_cache, (jnp.zeros((0,), jnp.int32) if counts is None
                              else counts.sum(axis=0))


def _layers(params: dict, config: ModelConfig, kv_cache: jax.Array, batch: BatchPlan,
            mesh: jax.sharding.Mesh | None, count_experts: bool) -> tuple:
    layer = DecoderLayer(config, mesh)
    layers, stacked = params["layers"], None
    if _projections_in_place(config, mesh, batch.token_ids.shape[0]):
        stacked = {name: layers[name] for name in PROJECTIONS if name in layers}
        layers = {name: p for name, p in layers.items() if name not in PROJECTIONS}

    moe_mlp = (moe.layer_mlp(config, params, _ACTIVATIONS[config.hidden_act],
                             _precision(config), mesh) if config.num_experts else None)

    moe_counts = None
    if count_experts:
        valid = jnp.arange(batch.token_ids.shape[0]) < batch.cu_q_lens[batch.num_seqs[0]]
        moe_counts = moe.layer_expert_tokens(config, params, valid)

    rope = rope_tables(config, batch.positions)

    def body(carry, xs):
        layer_params, layer_id = xs
        return layer.apply({"params": layer_params}, carry, layer_id, batch, rope, stacked,
                           moe_mlp, moe_counts)

    x = jnp.take(params["embed_tokens"], batch.token_ids, axis=0)
    if (fmt := _block_format(config, "embed_tokens")) is not None:
        x = cpu_matmul.dequantize(x, fmt)
    if config.embedding_multiplier != 1.0:
        # In the activations' dtype, as HF rounds it (Gemma: sqrt(hidden) in bf16).
        x = x * jnp.asarray(config.embedding_multiplier, x.dtype)
    layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
    (x, kv_cache), counts = jax.lax.scan(body, (x, kv_cache), (layers, layer_ids))
    return rms_norm(x, params["norm"], config.rms_norm_eps, config.norm_offset), kv_cache, counts


def compute_logits(params: dict, config: ModelConfig, hidden_rows: jax.Array) -> jax.Array:
    """LM head on the rows that sample (hidden[batch.logits_indices]): f32 logits [N, vocab],
    soft-capped where the family does (Gemma 2). GGUF blocks (quantization "gguf") are read in
    place by the CPU kernel for up to QUANTIZED_MAX_ROWS rows, else dequantized whole."""
    name = "embed_tokens" if config.tie_word_embeddings else "lm_head"
    if (fmt := _block_format(config, name)) is not None:
        w = params[name]  # [V, H / 32 * bytes] either way
        if cpu_kernels.enabled() and hidden_rows.shape[0] <= cpu_matmul.QUANTIZED_MAX_ROWS:
            logits = cpu_matmul.quantized_matmul(hidden_rows, w[None], 0, fmt,
                                                 config.gguf_dot == "int8")
        else:
            logits = jnp.einsum("nh,vh->nv", hidden_rows, cpu_matmul.dequantize(w, fmt),
                                precision=_precision(config), preferred_element_type=jnp.float32)
    elif config.tie_word_embeddings:
        logits = jnp.einsum("nh,vh->nv", hidden_rows, params["embed_tokens"],
                            precision=_precision(config), preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("nh,hv->nv", hidden_rows, params["lm_head"],
                            precision=_precision(config), preferred_element_type=jnp.float32)
    cap = config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

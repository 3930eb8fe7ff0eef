"""The mixture-of-experts MLP (jaxserve.executor.models.moe) against a per-token loop: dropless
whatever the load (one expert taking most tokens, another none), both top-k weightings; the
CPU's tiled grouped matmul against XLA's ragged_dot (what GPUs and TPUs run); and the CPU's
grouped-matmul kernel, reading each layer's experts in place from the stacks, against the tiles
(with gpt-oss's biases and clamped SwiGLU). The HF comparison of whole models is
tests/test_model_families.py's (the kernel in use there where the CPU kernels are)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.executor.models import moe
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels import grouped_matmul as cpu_grouped


def _config(norm_topk_prob: bool) -> ModelConfig:
    return ModelConfig(name="moe", vocab_size=16, hidden_size=8, intermediate_size=12,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, num_experts=5,
                       experts_per_token=2, moe_intermediate_size=6,
                       norm_topk_prob=norm_topk_prob)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_every_token_reaches_its_top_k_experts_however_skewed(norm_topk_prob):
    c = _config(norm_topk_prob)
    params = nn.unbox(moe.boxed_init(c, jax.random.key(0)))["moe"]
    p = {k: np.array(v[0]) for k, v in params.items()}
    # Expert 0 first choice for every token, expert 4 never chosen: groups of 23, ~23, 0.
    x = np.random.default_rng(0).normal(size=(23, c.hidden_size)).astype(np.float32)
    x[:, 0] = 3.0
    p["router"][0, 0] += 20.0
    p["router"][0, 4] -= 20.0
    run = jax.jit(moe.experts_mlp, static_argnums=(2, 3, 4))  # one compile, not op by op
    got = np.asarray(run(jnp.asarray(x), p, c, jax.nn.silu, jax.lax.Precision.HIGHEST))

    want = np.zeros_like(x)
    for t, row in enumerate(x.astype(np.float64)):
        logits = row @ p["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        weights = probs[top] / (probs[top].sum() if norm_topk_prob else 1.0)
        for e, w in zip(top, weights):
            g, u = row @ p["gate_proj"][e], row @ p["up_proj"][e]
            want[t] += w * ((g / (1 + np.exp(-g)) * u) @ p["down_proj"][e])
    order = np.argsort(-(x @ p["router"]), axis=1)
    assert (order[:, 0] == 0).all() and (order[:, :2] != 4).all()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_sizes", [[0, 37, 1, 0, 2], [1, 1, 1, 0, 0], [40, 0, 0, 0, 0]])
def test_tiled_grouped_matmul_equals_ragged_dot(group_sizes):
    c = _config(True)
    p = {k: v[0] for k, v in nn.unbox(moe.boxed_init(c, jax.random.key(1)))["moe"].items()}
    n = sum(group_sizes)
    rows = jax.random.normal(jax.random.key(2), (n, c.hidden_size))
    sizes = jnp.asarray(group_sizes, jnp.int32)
    args = (sizes, p, moe.gated(c, jax.nn.silu), jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(moe.tiled_grouped_mlp(rows, *args),
                               moe.ragged_grouped_mlp(rows, *args), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.enabled(),
                    reason="the CPU kernels' library")
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_cpu_kernel_reads_each_layer_in_place_as_the_tiles_compute_it(gpt_oss):
    extra = dict(moe_bias=True, swiglu_limit=0.5) if gpt_oss else {}  # a clamp that binds
    c = ModelConfig(name="moe", vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=3,
                    num_heads=2, num_kv_heads=1, head_dim=16, num_experts=6,
                    experts_per_token=2, moe_intermediate_size=16, norm_topk_prob=True, **extra)
    assert moe.experts_in_place(c, None)
    stacks = {k: np.array(v) for k, v in nn.unbox(moe.boxed_init(c, jax.random.key(3)))["moe"]
              .items()}
    stacks["router"][1, :, 2] += 5.0  # layer 1: expert 2 takes most tokens
    x = np.random.default_rng(1).normal(size=(19, c.hidden_size)).astype(np.float32)
    args = (c, jax.nn.silu, jax.lax.Precision.HIGHEST)
    kernel = jax.jit(lambda x, p, layer: moe.experts_mlp(x, p, *args, layer=layer))
    tiles = jax.jit(lambda x, p: moe.experts_mlp(x, p, *args))
    for layer in range(3):
        want = tiles(x, {k: v[layer] for k, v in stacks.items()})
        got = kernel(x, stacks, np.int32(layer))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert cpu_grouped._TARGET in kernel.lower(x, stacks, np.int32(0)).as_text()

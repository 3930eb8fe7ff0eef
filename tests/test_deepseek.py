"""DeepSeek-V3 (multi-head latent attention, its compressed paged cache, its router) beyond the HF
comparison every family gets in tests/test_model_families.py (logits within 1e-4 and 32 greedy
tokens under chunked prefill, prefix caching and preemption, through the latent cache):
- the latent attention's XLA path against its float64 reference (mla_reference.py) on ragged
  batches of prefill chunks, decodes and padding;
- the pool's MLA layout: what a page holds and how many pages the memory left buys;
- the router (sigmoid scores, group-limited top-k with the correction bias, scaling) against a
  per-token loop.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.kernels.attention import mla as mla_kernel
from jaxserve.kernels.attention.mla_reference import mla_ragged_paged_attention as reference
from jaxserve.shapes import cdiv
from tests.test_model_families import FIXTURES

FAMILY = "deepseek_v3"


def _batch(q_lens, kv_lens, page_size, num_pages, rng, pad_seqs=1):
    """A ragged batch: each sequence's pages drawn at random from the pool (page 0 excluded)."""
    S = len(q_lens) + pad_seqs
    pages_per_seq = max(cdiv(k, page_size) for k in kv_lens)
    free = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((S, pages_per_seq), np.int32)
    used = 0
    for s, k in enumerate(kv_lens):
        n = cdiv(k, page_size)
        table[s, :n] = free[used:used + n]
        used += n
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    lens = np.zeros(S, np.int32)
    lens[:len(kv_lens)] = kv_lens
    return lens, table, cu, np.asarray([len(q_lens)], np.int32)


@pytest.mark.parametrize("q_lens, kv_lens", [
    ([1, 1, 1], [5, 40, 1]),  # decodes only
    ([37, 1, 9, 1, 2], [37, 70, 20, 3, 2]),  # prefill chunks, decodes, a short query
    ([1], [130]),  # one decode over many KV blocks
])
def test_latent_attention_matches_the_float64_reference(q_lens, kv_lens):
    rng = np.random.default_rng(0)
    H, R, Dr, page_size, num_pages = 3, 16, 8, 4, 80
    kv_lens_a, table, cu, num_seqs = _batch(q_lens, kv_lens, page_size, num_pages, rng)
    T = int(sum(q_lens)) + 3  # padding rows past the last sequence
    q = rng.standard_normal((T, H, R + Dr)).astype(np.float32)
    cache = rng.standard_normal((num_pages, page_size, R + Dr)).astype(np.float32)
    args = (q, cache, kv_lens_a, table, cu, num_seqs)
    want = reference(*args, kv_lora_rank=R, sm_scale=0.3)
    run = jax.jit(mla_kernel.mla_ragged_paged_attention,
                  static_argnames=("kv_lora_rank", "sm_scale"))
    got = np.asarray(run(*map(jnp.asarray, args), kv_lora_rank=R, sm_scale=0.3))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert not got[int(sum(q_lens)):].any()


def test_latent_attention_refuses_mismatched_shapes():
    z = np.zeros
    with pytest.raises(ValueError, match="latent width differs"):
        mla_kernel.mla_ragged_paged_attention(
            z((2, 1, 24)), z((4, 4, 20)), z(1, np.int32), z((1, 1), np.int32),
            z(2, np.int32), z(1, np.int32), kv_lora_rank=16, sm_scale=1.0)


def _fixture_config():
    from jaxserve.weights.architectures import config_from_hf

    return config_from_hf(json.loads((FIXTURES / FAMILY / "config.json").read_text()), FAMILY)


def test_the_pool_stores_latents_and_sizes_its_pages_by_them():
    from jaxserve.executor.runner import kv_page_bytes, num_pages_for

    c = _fixture_config()
    m = c.mla
    # One row per token and layer: the latent and the rope key, nothing per head.
    assert kv_page_bytes(c, 16, "bfloat16") == c.num_layers * 16 * (m.kv_lora_rank
                                                                     + m.qk_rope_head_dim) * 2
    standard = kv_page_bytes(c.replace(mla=None, head_dim=m.qk_nope_head_dim
                                       + m.qk_rope_head_dim), 16, "bfloat16")
    assert standard == 2 * c.num_layers * 16 * c.num_heads * 16 * 2  # 128 values a token here
    budget = 1 << 20
    pages = num_pages_for(c, CacheConfig(page_size=16, dtype="bfloat16",
                                         kv_cache_memory_fraction=0.5),
                          SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=1024,
                                          max_model_len=4096), memory_bytes=budget)
    assert pages == budget // 2 // kv_page_bytes(c, 16, "bfloat16")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_sigmoid_routing_matches_a_per_token_loop(norm_topk_prob):
    from jaxserve.executor.models import moe

    c = _fixture_config().replace(norm_topk_prob=norm_topk_prob)
    p = {k: np.array(v[0]) for k, v in nn.unbox(moe.boxed_init(c, jax.random.key(0)))["moe"].items()}
    bias = np.random.default_rng(1).normal(0, 0.3, c.num_experts).astype(np.float32)
    x = np.random.default_rng(2).normal(size=(50, c.hidden_size)).astype(np.float32)
    experts, weights = jax.jit(moe.grouped_route, static_argnums=3)(
        jnp.asarray(x), jnp.asarray(p["router"]), jnp.asarray(bias), c)
    size = c.num_experts // c.moe_num_groups
    for t, row in enumerate(x.astype(np.float64)):
        scores = 1 / (1 + np.exp(-(row @ p["router"])))
        choice = scores + bias
        groups = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(c.moe_num_groups)]
        best = np.argsort([-sum(g) for g in groups])[:c.moe_topk_groups]
        allowed = [e for e in range(c.num_experts) if e // size in best]
        top = sorted(allowed, key=lambda e: -choice[e])[:c.experts_per_token]
        w = scores[top] / (scores[top].sum() if norm_topk_prob else 1.0)
        assert sorted(np.asarray(experts[t]).tolist()) == sorted(top)
        got = dict(zip(np.asarray(experts[t]).tolist(), np.asarray(weights[t]).tolist()))
        np.testing.assert_allclose([got[e] for e in top], w * c.routed_scaling_factor,
                                   rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
    ({"num_key_value_heads": 2}, "latent attention needs num_kv_heads == num_heads"),
    ({"n_group": 3}, "expert groups must divide the 8 experts"),
])
def test_deepseek_configs_it_cannot_serve_are_refused(change, message):
    from jaxserve.errors import ConfigError
    from jaxserve.weights.architectures import config_from_hf

    cfg = json.loads((FIXTURES / FAMILY / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**cfg, **change}, FAMILY)

"""Llama-family model: paged ragged forward vs an independent dense float64 numpy model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.executor.batch_plan import SeqChunk, make_plan
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.executor.models import decoder

PAGE_SIZE = 4
NUM_PAGES = 24


def tiny_config(**changes) -> ModelConfig:
    base = dict(name="tiny", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)
    base.update(changes)
    return ModelConfig(**base)


# ---------------------------------------------------------------- independent dense float64 model

def _np_rope(x, positions, inv_freq):
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :].astype(np.float64)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def dense_reference(params, config: ModelConfig, token_ids) -> tuple[np.ndarray, np.ndarray]:
    """One full sequence, full causal attention, no cache: (final-normed hidden [T,H], logits)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    ids = np.asarray(token_ids)
    T = len(ids)
    pos = np.arange(T)
    inv_freq = decoder.rope_frequencies(config.rope_theta, config.rope_scaling, config.head_dim)[0]
    group = config.num_heads // config.num_kv_heads
    mask = pos[None, :] <= pos[:, None]
    if config.sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - config.sliding_window
    x = p["embed_tokens"][ids]
    for l in range(config.num_layers):
        lp = {k: v[l] for k, v in p["layers"].items()}
        h = _np_norm(x, lp["input_norm"], config.rms_norm_eps)
        q = np.einsum("th,hnd->tnd", h, lp["q_proj"])
        k = np.einsum("th,hnd->tnd", h, lp["k_proj"])
        v = np.einsum("th,hnd->tnd", h, lp["v_proj"])
        if config.attention_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        q, k = _np_rope(q, pos, inv_freq), _np_rope(k, pos, inv_freq)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("qnd,knd->nqk", q, k) / np.sqrt(config.head_dim)
        s = np.where(mask[None], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        x = x + np.einsum("nqk,knd,ndh->qh", w, v, lp["o_proj"])
        h = _np_norm(x, lp["post_attention_norm"], config.rms_norm_eps)
        g, u = h @ lp["gate_proj"], h @ lp["up_proj"]
        x = x + (g / (1 + np.exp(-g)) * u) @ lp["down_proj"]
    hidden = _np_norm(x, p["norm"], config.rms_norm_eps)
    head = p["embed_tokens"].T if config.tie_word_embeddings else p["lm_head"]
    return hidden, hidden @ head


# ---------------------------------------------------------------- paged ragged driving

@functools.partial(jax.jit, static_argnums=1, donate_argnums=2)
def _step(params, config, kv_cache, batch):
    hidden, kv_cache = decoder.forward(params, config, kv_cache, batch)
    return hidden, decoder.compute_logits(params, config, hidden[batch.logits_indices]), kv_cache


def run_steps(params, config, steps, *, num_tokens_padded=16, num_seqs_padded=4, pages_per_seq=4):
    """Run ragged steps; each step is a list of SeqChunk. Returns per-step (hidden, logits) numpy."""
    kv_cache = decoder.init_kv_cache(config, NUM_PAGES, PAGE_SIZE)
    out = []
    for chunks in steps:
        plan = make_plan(chunks, num_tokens_padded=num_tokens_padded,
                         num_seqs_padded=num_seqs_padded, pages_per_seq=pages_per_seq,
                         page_size=PAGE_SIZE)
        hidden, logits, kv_cache = _step(params, config, kv_cache, jax.tree.map(jnp.asarray, plan))
        out.append((np.asarray(hidden, np.float64), np.asarray(logits, np.float64)))
    return out


def _three_sequences(config, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in (6, 11, 3)]
    tables = [[1, 2], [5, 7, 9], [12]]  # scattered, non-contiguous pages; page 0 is never used
    return seqs, tables


@pytest.mark.parametrize("changes", [
    {},  # Llama / SmolLM2: GQA, untied head
    {"tie_word_embeddings": True},
    {"attention_bias": True, "num_kv_heads": 1},  # Qwen2-style biases, MQA
    {"sliding_window": 3, "num_kv_heads": 4},  # Mistral-style window, MHA
    {"rope_scaling": RopeScaling(factor=8.0, original_max_position_embeddings=16)},  # Llama 3
])
@pytest.mark.parametrize("weights", ["in_place", "sliced"])
def test_ragged_paged_forward_matches_dense(changes, weights, monkeypatch):
    config = tiny_config(**changes)
    # The step's projections read the stacked weights in place through the CPU kernel where it is
    # built (16 tokens: within its rows), else each layer's slice through XLA's dots.
    if weights == "sliced":
        monkeypatch.setattr(decoder, "_projections_in_place", lambda *args: False)
    elif not decoder._projections_in_place(config, None, 16):
        pytest.skip("the CPU matmul kernel is not built here")
    jax.clear_caches()  # _step's trace depends on the choice
    params = decoder.init_params(config, jax.random.key(1))
    seqs, tables = _three_sequences(config)
    # (sequence, start, end) per chunk. Step 1: prefill seq 0 and seq 1's first chunk; step 2: a
    # decode, seq 1's middle chunk crossing pages, seq 2's prefill; step 3: a decode and a 1-token
    # chunk finishing seq 1.
    schedule = [
        [(0, 0, 5), (1, 0, 4)],
        [(0, 5, 6), (1, 4, 10), (2, 0, 2)],
        [(2, 2, 3), (1, 10, 11)],
    ]
    steps = [[SeqChunk(seqs[i][s:e], s, tables[i]) for i, s, e in step] for step in schedule]
    results = run_steps(params, config, steps)
    refs = [dense_reference(params, config, s) for s in seqs]
    for step, (hidden, logits) in zip(schedule, results):
        row = 0
        for slot, (i, s, e) in enumerate(step):
            ref_hidden, ref_logits = refs[i]
            np.testing.assert_allclose(hidden[row:row + e - s], ref_hidden[s:e], atol=2e-4,
                                       rtol=2e-4)
            np.testing.assert_allclose(logits[slot], ref_logits[e - 1], atol=1e-3, rtol=1e-3)
            row += e - s


def test_bf16_forward_close_to_f32():
    config = tiny_config()
    params = decoder.init_params(config, jax.random.key(2))
    seq = np.random.default_rng(3).integers(0, config.vocab_size, 9).tolist()
    steps = [[SeqChunk(seq, 0, [3, 4, 6])]]
    (_, logits32), = run_steps(params, config, steps)
    cfg16 = config.replace(dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    (_, logits16), = run_steps(params16, cfg16, steps)
    # bf16 keeps 8 mantissa bits; through 3 layers logits of unit scale drift by a few 1e-2.
    np.testing.assert_allclose(logits16, logits32, atol=0.15, rtol=0.05)
    assert logits16.dtype == np.float64 and np.argmax(logits16[0]) == np.argmax(logits32[0])


def _q4_1_exact(params: dict) -> dict:
    """The projections rounded to what a Q4_1 GGUF holds (16 levels per 32 contraction rows)."""
    from gguf import GGMLQuantizationType, quants

    layers = dict(params["layers"])
    for name, num_contract in decoder.PROJECTIONS.items():
        w = np.asarray(layers[name])
        rows = w.reshape(w.shape[0], -1, int(np.prod(w.shape[1 + num_contract:])))
        t = np.ascontiguousarray(rows.transpose(0, 2, 1))  # blocks run along the contraction
        t = quants.dequantize(quants.quantize(t, GGMLQuantizationType.Q4_1),
                              GGMLQuantizationType.Q4_1)
        layers[name] = t.transpose(0, 2, 1).reshape(w.shape)
    return {**params, "layers": layers}


GGUF_FORMATS = (("q_proj", "q4_0"), ("k_proj", "q4_1"), ("v_proj", "q8_0"), ("o_proj", "q4_1"),
                ("gate_proj", "q4_0"), ("up_proj", "q8_0"), ("down_proj", "q4_1"),
                ("embed_tokens", "q4_1"), ("lm_head", "q8_0"))


def _dequantized(params: dict, config) -> dict:
    """GGUF-block params as the f32 tree of the same values (what loading with --quantization
    none gives)."""
    from jaxserve.kernels.matmul import dequantize

    formats = dict(config.gguf_formats)
    f32 = decoder.param_shapes(config.replace(quantization=None, gguf_formats=()))
    layers = dict(params["layers"])
    for name in decoder.PROJECTIONS:
        w = np.asarray(dequantize(layers[name], formats[name]))  # [L, N, K]
        layers[name] = w.transpose(0, 2, 1).reshape(f32["layers"][name].shape)
    return {**params, "layers": layers,
            "embed_tokens": np.asarray(dequantize(params["embed_tokens"], formats["embed_tokens"])),
            "lm_head": np.asarray(dequantize(params["lm_head"], formats["lm_head"])).T}


@pytest.mark.parametrize("weights", ["in_place", "sliced"])
def test_gguf_blocks_give_the_forward_of_their_dequantized_weights(weights, monkeypatch):
    # Every format on some projection, the embedding and the LM head. In place: the CPU kernel
    # reads the blocks (8 tokens); sliced: each layer's blocks dequantized through XLA.
    config = tiny_config(intermediate_size=64)
    cfg_q = config.replace(quantization="gguf", gguf_formats=GGUF_FORMATS)
    if weights == "sliced":
        monkeypatch.setattr(decoder, "_projections_in_place", lambda *args: False)
    elif not decoder._projections_in_place(cfg_q, None, 8):
        pytest.skip("the CPU kernels are not built here")
    jax.clear_caches()  # _step's trace depends on the choice
    params = jax.tree.map(np.asarray, decoder.init_params(cfg_q, jax.random.key(4)))
    assert params["layers"]["o_proj"].shape == (3, 32, 64 // 32 * 20)  # [L, N, K / 32 * bytes]
    seq = np.random.default_rng(5).integers(0, config.vocab_size, 9).tolist()
    steps = [[SeqChunk(seq[:8], 0, [3, 4])], [SeqChunk(seq[8:], 8, [3, 4, 6])]]
    for (hq, lq), (h32, l32) in zip(run_steps(params, cfg_q, steps, num_tokens_padded=8),
                                    run_steps(_dequantized(params, cfg_q), config, steps,
                                              num_tokens_padded=8)):
        np.testing.assert_allclose(hq, h32, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lq, l32, atol=1e-5, rtol=1e-5)
    assert np.abs(l32).max() > 0.1  # real signal through the random blocks


def test_gguf_int8_dot_moves_the_logits_of_small_steps_a_little():
    # gguf_dot "int8" (--gguf-dot int8): steps of up to 4 tokens (here both, a prefill of 4 and a
    # decode, and the LM head's rows) round the activations to int8 per block of 32 before the
    # kernel's integer dot products (their arithmetic: tests/test_cpu_kernels.py): the logits
    # move, a little. Without the blocks there is nothing to round: a clear error.
    from jaxserve.errors import ConfigError

    config = tiny_config(intermediate_size=64)
    cfg_q = config.replace(quantization="gguf", gguf_formats=GGUF_FORMATS)
    if not decoder._projections_in_place(cfg_q, None, 4):
        pytest.skip("the CPU kernels are not built here")
    params = jax.tree.map(np.asarray, decoder.init_params(cfg_q, jax.random.key(4)))
    seq = np.random.default_rng(5).integers(0, config.vocab_size, 5).tolist()
    steps = [[SeqChunk(seq[:4], 0, [3, 4])], [SeqChunk(seq[4:], 4, [3, 4])]]
    f32 = run_steps(params, cfg_q, steps, num_tokens_padded=4)
    int8 = run_steps(params, cfg_q.replace(gguf_dot="int8"), steps, num_tokens_padded=4)
    for (_, l32), (_, l8) in zip(f32, int8):
        # (measured: 0.12 of logits up to 5.1, 3 random layers; each output ~0.5% of its scale)
        assert 0 < np.abs(l8 - l32).max() < 0.05 * np.abs(l32).max(), np.abs(l8 - l32).max()
    with pytest.raises(ConfigError, match="gguf_dot"):
        config.replace(gguf_dot="int8")


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_int8_weights_give_the_f32_forward_of_q4_1_weights(monkeypatch, kernels):
    # auto: the blocks read in place by the CPU kernel (steps of up to 64 tokens); off: each
    # layer dequantized inside the step by XLA.
    from jaxserve.errors import ConfigError
    from jaxserve.kernels import cpu as cpu_kernels
    from jaxserve.weights.quantize import quantize_int8

    monkeypatch.setenv(cpu_kernels.ENV, kernels)
    jax.clear_caches()  # (the step's programs are cached by config, not by the switch)

    config = tiny_config(intermediate_size=64)
    params = _q4_1_exact(jax.tree.map(np.asarray, decoder.init_params(config, jax.random.key(4))))
    seq = np.random.default_rng(5).integers(0, config.vocab_size, 9).tolist()
    steps = [[SeqChunk(seq[:8], 0, [3, 4])], [SeqChunk(seq[8:], 8, [3, 4, 6])]]
    cfg8 = config.replace(quantization="int8")
    params8 = quantize_int8(params)
    # The tree the model declares for int8: blocks of f32 scale, f32 min and 32 codes per row.
    assert jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), params8) == jax.tree.map(
        lambda x: (x.shape, np.dtype(x.dtype)), decoder.param_shapes(cfg8))
    assert params8["layers"]["o_proj"].shape == (3, 32, 4 * 16 // 32 * 40)
    assert decoder._projections_in_place(cfg8, None, 8) == (kernels == "auto"
                                                            and cpu_kernels.enabled())
    for (h32, l32), (h8, l8) in zip(run_steps(params, config, steps),
                                    run_steps(params8, cfg8, steps)):
        # Q4_1's levels land on int8 codes exactly: only f32 rounding of the dequantization.
        np.testing.assert_allclose(h8, h32, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(l8, l32, atol=1e-5, rtol=1e-5)
    # Other weights lose up to half a step of (max - min) / 255 per group: close, not equal.
    plain = jax.tree.map(np.asarray, decoder.init_params(config, jax.random.key(4)))
    (_, l32), = run_steps(plain, config, steps[:1])
    (_, l8), = run_steps(quantize_int8(plain), cfg8, steps[:1])
    assert 0 < np.abs(l8 - l32).max() < 0.05
    with pytest.raises(ConfigError, match="divisible by 32"):
        tiny_config(quantization="int8")
    with pytest.raises(ConfigError, match="quantization must be one of"):
        tiny_config(quantization="fp8")
    jax.clear_caches()


def test_params_tree_and_logical_axes():
    config = tiny_config(attention_bias=True)
    params = decoder.init_params(config, jax.random.key(0))
    axes = decoder.param_logical_axes(config)
    L, H = config.num_layers, config.hidden_size
    assert params["layers"]["q_proj"].shape == (L, H, config.num_heads, config.head_dim)
    assert params["layers"]["k_bias"].shape == (L, config.num_kv_heads, config.head_dim)
    assert tuple(axes["layers"]["k_proj"]) == ("layers", "embed", "kv_heads", "head_dim")
    assert tuple(axes["embed_tokens"]) == ("vocab", "embed")
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert "lm_head" not in decoder.init_params(config.replace(tie_word_embeddings=True),
                                              jax.random.key(0))


def test_program_size_does_not_grow_with_depth():
    def n_eqns(num_layers):
        config = tiny_config(num_layers=num_layers)
        params = decoder.param_shapes(config)
        cache = jax.ShapeDtypeStruct((num_layers * 4, PAGE_SIZE, 4, 16), jnp.float32)
        plan = make_plan([SeqChunk([1, 2], 0, [1])], num_tokens_padded=4, num_seqs_padded=2,
                         pages_per_seq=1, page_size=PAGE_SIZE)
        jaxpr = jax.make_jaxpr(functools.partial(decoder.forward, config=config))(
            params, kv_cache=cache, batch=jax.tree.map(jnp.asarray, plan))
        return len(jaxpr.jaxpr.eqns)

    assert n_eqns(2) == n_eqns(12)


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies():
    base = tiny_config(head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0,
                                                   original_max_position_embeddings=8192))
    f0, f1 = (decoder.rope_frequencies(c.rope_theta, c.rope_scaling, c.head_dim)[0]
              for c in (base, scaled))
    wavelen = 2 * np.pi / f0
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    np.testing.assert_allclose(f1[high], f0[high], rtol=1e-6)
    np.testing.assert_allclose(f1[low], f0[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8.0))


# ---------------------------------------------------------------- real SmolLM2 vs HF golden


@functools.partial(jax.jit, static_argnums=1)
def _prefill_logits(params, config, kv_cache, batch):
    hidden, _ = decoder.forward(params, config, kv_cache, batch)
    return decoder.compute_logits(params, config, hidden)


@pytest.mark.slow
def test_smollm2_forward_matches_hf_golden(smollm2, smollm2_golden):
    config, params = smollm2
    page_size, pages_per_seq = 16, 4
    cache = decoder.init_kv_cache(config, num_pages=pages_per_seq + 1, page_size=page_size)
    for case in smollm2_golden["cases"]:
        ids = case["input_ids"]
        plan = make_plan([SeqChunk(ids, 0, list(range(1, pages_per_seq + 1)))],
                         num_tokens_padded=64, num_seqs_padded=1, pages_per_seq=pages_per_seq,
                         page_size=page_size)
        logits = np.asarray(_prefill_logits(params, config, cache, jax.tree.map(jnp.asarray, plan)))
        logits = logits[:len(ids)]
        argmax_match = np.mean(logits.argmax(-1) == np.asarray(case["prompt_argmax"]))
        assert argmax_match >= 0.99, (case["case"], argmax_match)
        last = logits[-1]
        assert np.argsort(-last)[:5].tolist() == case["last_top20_ids"][:5], case["case"]
        np.testing.assert_allclose(last[case["last_top20_ids"]], case["last_top20_logits"],
                                   atol=1e-2, rtol=0)

"""The CPU kernels (jaxserve.kernels.cpu): the one switch and what it turns off, the library
(jaxserve.kernels.cpu.library: its sources, handlers and cache), the sampler's top-k / top-p
thresholds (jaxserve.kernels.sampling) against a float64 reference and the pure-JAX path, the
stacked-weights matmul (jaxserve.kernels.matmul) and the experts' grouped matmul
(jaxserve.kernels.grouped_matmul) against float64 references (f32 and bf16 weights), the matmul on
GGUF blocks (Q4_0 / Q4_1 / Q8_0) against the gguf package's dequantization, and the library built
for older x86 ISAs. The attention kernel's tests are in test_ragged_paged_attention.py; the model
through the matmul kernel in test_llama.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.config import GGUF_FORMATS
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.cpu import library as cpu_library
from jaxserve.kernels import grouped_matmul as cpu_grouped
from jaxserve.kernels import matmul as cpu_matmul
from jaxserve.kernels import sampling as cpu_sampling
from jaxserve.executor import sampler
from tests import kernel_prebuild

ROOT = Path(__file__).resolve().parents[1]
needs_library = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_kernels.enabled(),
                                   reason="the CPU kernels' library")


def test_kernel_cache_prunes_builds_unused_for_the_max_age(tmp_path):
    day = 86400
    names = ("cpu_kernels-used", "cpu_kernels-old", "cpu_kernels-recent", "cpu_decode-old")
    libs = {name: tmp_path / f"{name}.so" for name in names}
    for lib in libs.values():
        lib.write_bytes(b"")
    other = tmp_path / "unrelated.so"
    other.write_bytes(b"")
    now = libs["cpu_kernels-used"].stat().st_mtime
    ages = {"cpu_kernels-used": 90, "cpu_kernels-old": 31, "cpu_kernels-recent": 29,
            "cpu_decode-old": 31}  # the last: a build under the library's former name
    for name, age in ages.items():
        os.utime(libs[name], (now - age * day, now - age * day))
    os.utime(other, (now - 90 * day, now - 90 * day))
    removed = cpu_library.prune_kernels(tmp_path, libs["cpu_kernels-used"], 30 * day)
    assert sorted(removed) == sorted([libs["cpu_kernels-old"], libs["cpu_decode-old"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cpu_kernels-recent.so", "cpu_kernels-used.so", "unrelated.so"]
    # The library in use was marked used now, whatever its age before.
    assert libs["cpu_kernels-used"].stat().st_mtime >= now


def test_the_library_builds_every_source_and_registers_every_handler_they_define():
    # Adding a kernel is its .cc and its wrapper: the sources are globbed, the handlers found in
    # them, and each wrapper's FFI target is one of theirs.
    from jaxserve.kernels.attention import cpu as attention_cpu

    assert [p.name for p in cpu_library.sources()] == [
        "attention.cc", "grouped_matmul.cc", "matmul.cc", "quantized_matmul.cc", "sampling.cc"]
    handlers = cpu_library.handlers()
    assert handlers["jaxserve_paged_decode"] == "JaxservePagedDecode"
    assert set(handlers) == {*attention_cpu.TARGETS, cpu_sampling._TARGET, cpu_matmul._TARGET,
                             cpu_matmul._QUANTIZED_TARGET, cpu_grouped._TARGET}
    assert cpu_library.plan().path.name == f"cpu_kernels-{cpu_library.plan().key}.so"


@pytest.mark.parametrize("value", ["", "on", "OFF", "1"])
def test_an_invalid_switch_is_a_clear_error(monkeypatch, value):
    from jaxserve.errors import ConfigError

    monkeypatch.setenv(cpu_kernels.ENV, value)
    with pytest.raises(ConfigError, match=f"JAXSERVE_CPU_KERNELS={value!r}: expected one of "
                                          f"auto, off"):
        cpu_kernels.enabled()


def test_switched_off_the_kernels_are_not_even_built(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    assert not cpu_kernels.enabled()
    assert cpu_kernels.why_off() == "JAXSERVE_CPU_KERNELS=off"
    assert not (tmp_path / "kernels").exists()


def _step_programs():
    """The HLO of a model step (16 tokens: decodes, the CPU kernels' shapes) and of the sampler
    over sampled rows with top-k and top-p, traced now."""
    from jaxserve.config import ModelConfig
    from jaxserve.executor.batch_plan import SeqChunk, make_plan
    from jaxserve.executor.models import decoder
    from jaxserve.executor.sampling_rows import SamplingRow
    from jaxserve.core.sampling_params import SamplingParams

    jax.clear_caches()
    config = ModelConfig(name="tiny", vocab_size=96, hidden_size=64, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
    params = decoder.init_params(config, jax.random.key(0))
    cache = decoder.init_kv_cache(config, 8, 4)
    plan = make_plan([SeqChunk([5], 3, [1, 2]), SeqChunk([7], 6, [3, 4])], num_tokens_padded=16,
                     num_seqs_padded=4, pages_per_seq=4, page_size=4)
    forward = jax.jit(lambda p, c, b: decoder.forward(p, config, c, b))
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_k=5, top_p=0.9), 1, [1], [])] * 2
    md = sampler.make_sampling_metadata(rows, 2, eos_token_ids=[0])
    return (forward.lower(params, cache, jax.tree.map(jax.numpy.asarray, plan)).as_text(),
            jax.jit(sampler.sample).lower(jax.numpy.zeros((2, 96)), md).as_text())


@needs_library
def test_switched_off_every_call_site_takes_its_xla_path(monkeypatch):
    # The attention's decodes, the layers' projections and the sampler's thresholds: each in the
    # step's programs with the switch on auto, none with it off.
    from jaxserve.kernels.attention import cpu as attention_cpu

    targets = {"attention": attention_cpu._TARGET, "matmul": cpu_matmul._TARGET,
               "sampler": cpu_sampling._TARGET}
    forward, sample = _step_programs()
    assert {name: t in forward + sample for name, t in targets.items()} == dict.fromkeys(
        targets, True)
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    forward, sample = _step_programs()
    assert not [t for t in cpu_library.handlers() if t in forward + sample]
    jax.clear_caches()


def _reference_keep(x, top_k, top_p):
    """What top-k then top-p keep of each row, in float64: sort, count, accumulate."""
    keep = np.zeros(x.shape, bool)
    for r, row in enumerate(x.astype(np.float64)):
        values = np.sort(row[np.isfinite(row)])[::-1]
        t = -np.inf
        if 0 < top_k[r] < len(values):
            t = values[top_k[r] - 1]
        kept = values[values >= t]
        if top_p[r] < 1 and len(kept):
            mass = np.cumsum(np.exp(kept - kept[0]))
            t = max(t, kept[min(np.searchsorted(mass, top_p[r] * mass[-1]), len(kept) - 1)])
        keep[r] = row >= t
    return keep


def _case(rng, S, V, scale, decimals, low_outlier):
    x = (rng.standard_normal((S, V)) * scale).round(decimals).astype(np.float32)  # ties
    if low_outlier:  # a wide range: the kernel's buckets then hold many distinct values each
        x[:, -1] = -1000.0
    x[rng.random(x.shape) < 0.05] = -np.inf  # blocked tokens
    x[0] = -np.inf  # a row with nothing finite
    x[1, :] = 1.5  # one with every value tied
    top_k = rng.choice([0, 1, 2, 5, 40, V - 1, V, 10 * V], S).astype(np.int32)
    top_p = rng.choice([1.0, 0.01, 0.5, 0.9, 0.95, 0.999], S).astype(np.float32)
    return x, top_k, top_p


@needs_library
@pytest.mark.parametrize("V,scale,decimals,low_outlier", [
    (7, 1.0, 1, False), (300, 5.0, 0, False), (1000, 3.0, 6, False), (49152, 3.0, 6, False),
    (49152, 0.3, 2, False), (49152, 1.0, 6, True)])
def test_sampling_thresholds_keep_what_a_float64_reference_keeps(V, scale, decimals, low_outlier):
    rng = np.random.default_rng(V + decimals)
    x, top_k, top_p = _case(rng, 24, V, scale, decimals, low_outlier)
    t = np.asarray(jax.jit(cpu_sampling.thresholds)(x, top_k, top_p))
    np.testing.assert_array_equal(x >= t[:, None], _reference_keep(x, top_k, top_p))
    off = (top_k <= 0) & (top_p >= 1)
    assert np.isneginf(t[off]).all()


@needs_library
def test_sampling_thresholds_agree_with_the_pure_jax_bisection(monkeypatch):
    # Values far apart, so the bisection's f32 sums cannot move a boundary. The sampler's own
    # filter, on each of its two paths.
    rng = np.random.default_rng(3)
    x = rng.permutation(np.linspace(-8.0, 8.0, 3000)).astype(np.float32)[None].repeat(16, 0)
    md = SimpleNamespace(top_k=rng.choice([0, 3, 50, 2000], 16).astype(np.int32),
                         top_p=rng.choice([1.0, 0.3, 0.9, 0.99], 16).astype(np.float32))
    kept = {}
    for path in ("kernel", "bisection"):
        if path == "bisection":
            monkeypatch.setenv(cpu_kernels.ENV, "off")
        kept[path] = np.isfinite(np.asarray(sampler._top_k_top_p(jax.numpy.asarray(x), md)))
    np.testing.assert_array_equal(kept["kernel"], kept["bisection"])
    assert 0 < kept["kernel"].sum() < x.size  # some rows filtered


# (T, K, N). Tiles of rows x columns: AVX-512 8 x 48, AVX2 6 x 16, generic 4 x 8.
MATMUL_CASES = [
    (1, 16, 16),  # one row, one vector
    (9, 300, 80),  # a full row tile and a tail; two contraction blocks; AVX-512 panels 48 + 32
    (64, 600, 576),  # three contraction blocks, many panels over the threads
    (67, 1536, 192),  # a row tail (3 on AVX-512, 1 on AVX2); the MLP's down projection depth
]


WEIGHT_DTYPES = ["float32", "bfloat16"]


@needs_library
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("T,K,N", MATMUL_CASES)
def test_stacked_matmul_matches_a_float64_reference(T, K, N, weight_dtype):
    check_stacked_matmul(T, K, N, weight_dtype)


def _weights(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(jax.numpy.dtype(dtype))


def check_stacked_matmul(T: int, K: int, N: int, weight_dtype: str = "float32") -> None:
    """bf16 weights: also the f32 kernel's floats on their widening, bit for bit (the load keeps
    a bf16 checkpoint's weights bf16 on that promise: jaxserve.weights)."""
    rng = np.random.default_rng(T + K + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = _weights(rng, (3, K, N), weight_dtype)
    run = jax.jit(cpu_matmul.stacked_matmul)
    for layer in range(3):
        want = x.astype(np.float64) @ w[layer].astype(np.float64)
        got = np.asarray(run(x, w, np.int32(layer)))
        # f32 sums over K: ~1e-7 relative per term, far below a wrong row, column or layer.
        np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(K), rtol=0)
        if weight_dtype != "float32":
            np.testing.assert_array_equal(got, run(x, w.astype(np.float32), np.int32(layer)))


# (group sizes, K, N), 2 layers of experts; rows past the groups' sum must come out zero.
GROUPED_CASES = [
    ([0, 37, 1, 0, 2, 0], 300, 80),  # empty groups first, between and last; a row tail; 2 blocks
    ([41, 0, 0, 0], 64, 16),  # one group holding every row; one vector of columns
    ([3, 5, 0, 9, 1, 4, 0, 2], 512, 192),  # a decode's few rows per expert (Qwen3-30B's shape)
    ([0, 0, 0], 48, 32),  # no rows routed here (another device's experts)
]


@needs_library
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("sizes,K,N", GROUPED_CASES)
def test_grouped_matmul_matches_a_float64_reference(sizes, K, N, weight_dtype):
    check_grouped_matmul(sizes, K, N, weight_dtype)


def check_grouped_matmul(sizes: list[int], K: int, N: int, weight_dtype: str = "float32") -> None:
    """bf16 weights: also the f32 kernel's floats on their widening, bit for bit."""
    rng = np.random.default_rng(len(sizes) + K + N)
    rows = sum(sizes) + 3  # 3 rows past the groups: other devices' copies under EP
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = _weights(rng, (2, len(sizes), K, N), weight_dtype)
    group_sizes = np.asarray(sizes, np.int32)
    run = jax.jit(cpu_grouped.grouped_matmul)
    for layer in range(2):
        want = cpu_grouped.reference(x, w, layer, group_sizes)
        got = np.asarray(run(x, w, np.int32(layer), group_sizes))
        # f32 sums over K: ~1e-7 relative per term, far below a wrong group, row or layer.
        np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(K), rtol=0)
        assert not got[sum(sizes):].any()
        if weight_dtype != "float32":
            np.testing.assert_array_equal(
                got, run(x, w.astype(np.float32), np.int32(layer), group_sizes))


@needs_library
def test_grouped_matmul_refuses_group_sizes_past_its_rows():
    x, w = np.ones((4, 16), np.float32), np.ones((1, 2, 16, 16), np.float32)
    run = jax.jit(cpu_grouped.grouped_matmul)
    for sizes in ([3, 2], [5, -1]):
        with pytest.raises(Exception, match="group sizes negative or over the rows"):
            np.asarray(run(x, w, np.int32(0), np.asarray(sizes, np.int32)))


QUANTIZED_CASES = [  # T, K, N
    (1, 64, 5),  # a decode row; one block pair; an output tail (tiles of 4 or 2)
    (2, 64, 20),  # two rows: a row tile on every build
    (3, 96, 7),  # the integer path's rows; an odd number of blocks (AVX-512: a half pair)
    (6, 96, 8),  # past a tile of rows: the panel path (x padded to whole vectors of rows)
    (4, 576, 12),  # SmolLM2's hidden size: 18 blocks; the integer path's widest tile
    (9, 576, 36),  # the panel path over three blocks of 256 along K
    (37, 128, 70),  # wide: two panels of 32 outputs and a tail of 6, a tail of rows
    (64, 64, 9),  # x's rows as tiles split evenly (AVX-512: 2 + 2 vectors; AVX2: 4 x 2)
    (70, 64, 10),  # unevenly (AVX-512: 3 + 2; AVX2: 2, 2, 2, 2, 1; generic: 9 tiles)
]


@needs_library
@pytest.mark.parametrize("fmt", list(cpu_matmul.FORMATS))
def test_quantized_matmul_matches_the_gguf_dequantization(fmt):
    check_quantized_matmul(fmt)


def int8_reference(x: np.ndarray, blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The integer path of `quantized_matmul` in numpy, for x f32[T, K] and one layer's blocks
    u8[N, bytes]: x rounded to int8 per block as the kernel does (dx = max|x| / 127 in f32, codes
    rint(x * (1 / dx)), ties to even), each block's integer sum exact (int64), scaled by the f32
    product d_w * dx (Q4_1: plus m * the f32 dx * sum of x's codes), summed in float64. Returns
    that sum and the scale of the kernel's f32 rounding: each block's scale times the sum of its
    products' magnitudes (the kernel converts partial sums of a block, lane by lane; Q4_0's -8 *
    sum of x's codes is one of them), plus the m terms' magnitudes."""
    T, K = x.shape
    size, n = cpu_matmul.FORMATS[fmt], blocks.shape[0]
    xb = x.reshape(T, K // 32, 32)
    dx = np.abs(xb).max(-1) / np.float32(127)
    inverse = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx != 0)
    qx = np.rint(xb * inverse[..., None]).astype(np.int64)
    b = blocks.reshape(n, K // 32, size)
    half = lambda at: b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "q8_0":
        qw = b[..., 2:].view(np.int8).astype(np.int64)
    else:
        qs = b[..., size - 16:]
        qw = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    isum = np.einsum("tbj,nbj->tnb", qx, qw)
    partial = np.einsum("tbj,nbj->tnb", np.abs(qx), np.abs(qw))
    if fmt == "q4_0":  # the codes are nibble - 8
        isum, partial = isum - 8 * qx.sum(-1)[:, None], partial + 8 * np.abs(qx.sum(-1))[:, None]
    scale = (half(0)[None] * dx[:, None]).astype(np.float64)  # f32 [T, N, blocks]
    want, magnitude = (scale * isum).sum(-1), (np.abs(scale) * partial).sum(-1)
    if fmt == "q4_1":
        offset = dx * qx.sum(-1).astype(np.float32)  # f32 [T, blocks]
        m_terms = half(2)[None].astype(np.float64) * offset[:, None]
        want, magnitude = want + m_terms.sum(-1), magnitude + np.abs(m_terms).sum(-1)
    return want, magnitude


def int8_values(blocks: np.ndarray) -> np.ndarray:
    """The int8 storage's blocks u8[..., N, K / 32 * 40] as f32 [..., N, K]: code * d + m rounded
    once, as the kernel's FMA does (code * d is exact in float64, and so is the sum wherever m
    and the product are within 2^21 of each other: then one rounding to f32)."""
    b = blocks.reshape(*blocks.shape[:-1], -1, 40)
    d, m = (b[..., at:at + 4].copy().view(np.float32).astype(np.float64) for at in (0, 4))
    values = (b[..., 8:].astype(np.float64) * d + m).astype(np.float32)
    return values.reshape(*blocks.shape[:-1], -1)


def check_quantized_matmul(fmt: str) -> None:
    """The blocks as llama.cpp writes them (the gguf package's quantizer, on random weights):
    `dequantize` gives the package's f32 values exactly. The int8 storage's
    (jaxserve.weights.quantize): `int8_values`, which XLA's dequantization gives up to a rounding
    of the sum (it may not fuse the multiply and add); no integer path.

    f32 (int8_dot off): the kernel gives their product with x (f32 sums: ~1e-7 relative per
    term, far below a wrong block, nibble, row or layer). Within a tile of rows each row's floats
    are those of its own call. Past a tile of rows the kernel dequantizes into a panel first and
    runs the f32 kernel's tiles over it: its floats equal the f32 kernel's on the dequantized
    weights (the same products in the same order).

    int8 (the default; up to INT8_DOT_MAX_ROWS rows): `int8_reference`'s value within the f32
    rounding of its terms (a few units of 2^-24 of their magnitude each: far below one block's
    term, so a wrong code, scale, rounding or block fails), and within the 8-bit rounding's own
    bound of the exact product (each x off by at most dx / 2: sum of dx / 2 * |w| per block); each
    row's floats those of its own call. More rows: the f32 path's floats.

    Several weights in one call (a layer's q, k, v): each one's outputs side by side, the floats
    of its own call, on both paths."""
    from gguf import GGMLQuantizationType, quants

    from jaxserve.weights.quantize import int8_blocks

    gguf = fmt in GGUF_FORMATS
    run = jax.jit(cpu_matmul.quantized_matmul, static_argnums=(3, 4))
    stacked = jax.jit(cpu_matmul.stacked_matmul)
    for T, K, N in QUANTIZED_CASES:
        rng = np.random.default_rng(T + K + N)
        w = rng.standard_normal((2, N, K)).astype(np.float32)
        if gguf:
            kind = GGMLQuantizationType[fmt.upper()]
            blocks = np.stack([quants.quantize(layer, kind) for layer in w])
            values = np.stack([quants.dequantize(layer, kind) for layer in blocks])
            np.testing.assert_array_equal(np.asarray(cpu_matmul.dequantize(blocks, fmt)), values)
        else:
            blocks = int8_blocks(w)
            values = int8_values(blocks)
            assert np.abs(values - w).max() <= np.ptp(w) / 255  # half a step, at most
            # (XLA's two roundings: an ulp of |code * d| + |m| <= 3 max |w|, at most)
            np.testing.assert_allclose(np.asarray(cpu_matmul.dequantize(blocks, fmt)), values,
                                       rtol=0, atol=2.0 ** -21 * np.abs(values).max())
        x = rng.standard_normal((T, K)).astype(np.float32)
        x[0, :32] = 0  # a block of zeros: scale 0
        part = np.ascontiguousarray(blocks[:, :N // 2 + 1])
        for layer in range(2):
            exact = x.astype(np.float64) @ values[layer].T.astype(np.float64)
            f32 = np.asarray(run(x, blocks, np.int32(layer), fmt, False))
            np.testing.assert_allclose(f32, exact, atol=2e-5 * np.sqrt(K), rtol=0)
            if not gguf:
                with pytest.raises(Exception, match="int8_dot takes the GGUF formats only"):
                    run(x, blocks, np.int32(layer), fmt, True)
            got = np.asarray(run(x, blocks, np.int32(layer), fmt, True)) if gguf else f32
            if gguf and T <= cpu_matmul.INT8_DOT_MAX_ROWS:
                want, magnitude = int8_reference(x, blocks[layer], fmt)
                np.testing.assert_array_less(np.abs(got - want),
                                             (2 * K // 32 + 16) * 2.0 ** -24 * magnitude + 1e-30)
                dx = np.abs(x.reshape(T, -1, 32)).max(-1) / 127
                w_abs = np.abs(values[layer]).reshape(N, -1, 32).sum(-1)
                bound = (dx / 2) @ w_abs.T.astype(np.float64)
                np.testing.assert_array_less(np.abs(got - exact), 1.001 * bound + 1e-5)
            else:
                np.testing.assert_array_equal(got, f32)
            if T > 4:  # the panel path on every build: the f32 kernel's floats, bit for bit
                dense = np.zeros((K, N + -N % cpu_matmul.COLUMN_MULTIPLE), np.float32)
                dense[:, :N] = values[layer].T
                np.testing.assert_array_equal(
                    f32, np.asarray(stacked(x, dense[None], np.int32(0)))[:, :N])
            for int8_dot, full in ((False, f32), (True, got))[:2 if gguf else 1]:
                # Rows on the row tiles on every build (f32: 2 a tile on AVX2 and generic, 4 on
                # AVX-512). Many rows with int8_dot are the f32 path's floats, checked above.
                if 1 < T <= (cpu_matmul.INT8_DOT_MAX_ROWS if int8_dot else 2):
                    rows = [np.asarray(run(x[t:t + 1], blocks, np.int32(layer), fmt, int8_dot))
                            for t in range(T)]
                    np.testing.assert_array_equal(full, np.concatenate(rows))
                together = np.asarray(run(x, (blocks, part, blocks), np.int32(layer), fmt,
                                          int8_dot))
                alone = np.asarray(run(x, part, np.int32(layer), fmt, int8_dot))
                np.testing.assert_array_equal(together, np.concatenate([full, alone, full], 1))


# The library has a variant per x86 ISA (the attention's scores, attention.cc's Vec; the matmuls'
# tiles): AVX-512, AVX2, and the compiler's generic vectors. The suite's own build takes the
# host's; these build the others (in a subprocess, with its own kernel cache, so this process
# keeps its registered library) and check the attention and the matmul through them.
_OLDER_X86_SCRIPT = """
import numpy as np
from jaxserve.kernels import cpu
from jaxserve.kernels.matmul import FORMATS
from tests.test_cpu_kernels import (GROUPED_CASES, MATMUL_CASES, check_grouped_matmul,
                                    check_quantized_matmul, check_stacked_matmul)
from tests.test_ragged_paged_attention import check, make_case
assert cpu.enabled()
rng = np.random.default_rng(0)
for D, (hq, hkv) in ((64, (9, 3)), (128, (8, 1))):
    for cache_dtype in ("float32", "bfloat16"):
        for page_size in (2, 16):
            args = make_case(rng, q_lens=[1, 5, 1, 8, 3], ctx_lens=[40, 70, 0, 130, 20],
                             page_size=page_size, Hq=hq, Hkv=hkv, D=D, dtype="float32",
                             cache_dtype=cache_dtype)
            check("cpu", args, dtype="float32")
            check("cpu", args, dtype="float32", sliding_window=7, soft_cap=5.0)
for weight_dtype in ("float32", "bfloat16"):
    for case in MATMUL_CASES:
        check_stacked_matmul(*case, weight_dtype)
    for case in GROUPED_CASES:
        check_grouped_matmul(*case, weight_dtype)
for fmt in FORMATS:
    check_quantized_matmul(fmt)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA flags")
@pytest.mark.parametrize("flags", kernel_prebuild.OLDER_X86_FLAGS)
def test_cpu_kernels_built_for_older_x86_match_their_references(older_x86_prebuild, flags):
    # The build itself ran in the background since collection (tests/kernel_prebuild.py).
    cache = older_x86_prebuild.wait(flags)
    run = subprocess.run([sys.executable, "-c", _OLDER_X86_SCRIPT], cwd=ROOT,
                         env=kernel_prebuild.older_x86_env(flags, cache),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((cache / "kernels").glob("cpu_kernels-*.so")), "the kernel was not built"

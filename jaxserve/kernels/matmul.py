"""One layer's projection read in place from the stacked layers' weights, on the CPU, through a
C++ XLA FFI kernel (cpu/matmul.cc, in the CPU kernels' library: jaxserve.kernels.cpu.library);
and the same from GGUF quantized blocks (cpu/quantized_matmul.cc; `quantized_matmul`), with the
blocks' format table and their dequantization in JAX (`dequantize`, the reference and the XLA
path).

The model's scan over the layers otherwise slices each layer's weights out of the stack, a copy
XLA:CPU makes before the dots: in a decode step, whose matmuls have a row per sequence, that copy
streams every weight from memory and then the dots run, one after the other. The kernel computes
while it streams (see cpu/matmul.cc). jaxserve/executor/models/decoder.py uses it for steps of
MIN_ROWS to MAX_ROWS tokens: a decode step of one sequence is a matrix-vector product that XLA
streams as fast (measured: benchmarks/RESULTS.md, "The layers' projections read in place"), and
past MAX_ROWS the kernel, which rereads the rows for each column panel, was not measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_TARGET = "jaxserve_stacked_matmul"  # matmul.cc's JaxserveStackedMatmul
# The kernel's vector width divides its output columns: 16 floats covers AVX-512, AVX2 and SSE.
COLUMN_MULTIPLE = 16
MIN_ROWS, MAX_ROWS = 2, 512


# The weights' dtypes the f32 kernels read (matmul_tiles.h): bf16 widens to f32 exactly, in
# registers, so a bf16 checkpoint's weights stream half the bytes for the same sums.
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def supports(num_rows: int, shapes: list[tuple[int, int]], dtype) -> bool:
    """Whether the kernel takes `num_rows` f32 rows through weights of these (K, N) shapes in
    `dtype` (WEIGHT_DTYPES)."""
    return (jnp.dtype(dtype) in WEIGHT_DTYPES and MIN_ROWS <= num_rows <= MAX_ROWS
            and all(n % COLUMN_MULTIPLE == 0 for _, n in shapes))


def stacked_matmul(x, w, layer):
    """x f32[T, K] @ w[layer] for w f32 or bf16 [L, K, N] and a scalar layer index: f32[T, N]
    (bf16 weights widened exactly). Where `jaxserve.kernels.cpu.enabled()` and `supports`."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, jnp.asarray(layer, jnp.int32))


# Block formats read in place: bytes per block of BLOCK values along the contraction, and the
# kernel's code for each (quantized_matmul.cc's Format). llama.cpp's GGUF layouts: Q4_0 is an f16
# scale d and 16 bytes of nibbles (value j < 16 the low nibble of byte j, j + 16 its high one),
# w = d * (nibble - 8); Q4_1 adds an f16 minimum m after d, w = d * nibble + m; Q8_0 is d and 32
# signed bytes, w = d * byte. "int8", jaxserve's int8 storage (jaxserve.weights.quantize): an f32
# scale d, an f32 minimum m and 32 unsigned bytes, w = d * byte + m.
BLOCK = 32
FORMATS = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "int8": 40}
_FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "int8": 3}
_QUANTIZED_TARGET = "jaxserve_quantized_matmul"  # quantized_matmul.cc's JaxserveQuantizedMatmul
# Steps of up to this many tokens (and LM heads of up to this many rows) read the blocks in place;
# larger ones (prefill chunks) dequantize each layer through XLA and its dots. Past 4 rows the
# kernel dequantizes each block once per call into an L2-resident panel and runs every tile of
# rows over it (quantized_matmul.cc's Rows), so its cost past the blocks' stream grows with the
# rows as the f32 kernel's does (measured to 64: benchmarks/RESULTS.md, "GGUF blocks read in
# place": wider tiles").
QUANTIZED_MAX_ROWS = 64
# With int8_dot, steps of up to this many rows round x to int8 per block of 32 and take integer
# dot products (`quantized_matmul`; quantized_matmul.cc's kIntRows).
INT8_DOT_MAX_ROWS = 4


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one output row of `k` contraction values in format `fmt`."""
    return k // BLOCK * FORMATS[fmt]


def dequantize(blocks: jax.Array, fmt: str) -> jax.Array:
    """uint8 blocks [..., N, K / 32 * bytes] -> f32 [..., N, K]: the values the gguf package's
    dequantization gives (d * q exact in f32; Q4_1's + m rounded once)."""
    size = FORMATS[fmt]
    b = blocks.reshape(*blocks.shape[:-1], -1, size)
    if fmt == "int8":  # (the kernel rounds d * byte + m once; XLA may round twice: ~1 ulp)
        d, m = (jax.lax.bitcast_convert_type(b[..., at:at + 4].reshape(*b.shape[:-1], 1, 4),
                                             jnp.float32) for at in (0, 4))
        w = b[..., 8:].astype(jnp.float32) * d + m
        return w.reshape(*blocks.shape[:-1], -1)
    d = jax.lax.bitcast_convert_type(b[..., 0:2], jnp.float16).astype(jnp.float32)[..., None]
    if fmt == "q8_0":
        w = d * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    else:
        qs = b[..., size - 16:]
        q = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.float32)
        if fmt == "q4_0":
            w = d * (q - 8)
        else:
            m = jax.lax.bitcast_convert_type(b[..., 2:4], jnp.float16).astype(jnp.float32)
            w = d * q + m[..., None]
    return w.reshape(*blocks.shape[:-1], -1)


def random_blocks(key: jax.Array, rows: int, k: int, fmt: str, scale: float) -> jax.Array:
    """uint8 [rows, row_bytes] of valid blocks: random codes, d such that the values spread over
    about [-scale, scale] (random test models)."""
    size, blocks = FORMATS[fmt], k // BLOCK
    levels = 256 if fmt in ("q8_0", "int8") else 16
    scalar = np.float32 if fmt == "int8" else np.float16
    d = np.frombuffer(scalar(2 * scale / levels).tobytes(), np.uint8)
    head = [d] + ([np.frombuffer(scalar(-scale).tobytes(), np.uint8)]
                  if fmt in ("q4_1", "int8") else [])
    head = np.concatenate(head)
    head = jnp.broadcast_to(jnp.asarray(head), (rows, blocks, head.size))
    codes = jax.random.randint(key, (rows, blocks, size - head.shape[-1]), 0, 256).astype(
        jnp.uint8)
    return jnp.concatenate([head, codes], axis=-1).reshape(rows, blocks * size)


def quantized_matmul(x, w, layer, fmt: str, int8_dot: bool = False):
    """x f32[T, K] @ dequantize(w[layer], fmt).T for blocks w u8[L, N, K / 32 * bytes] and a
    scalar layer index: f32[T, N], read in place by the CPU kernel. `w` a tuple of such blocks
    (one format, one K): their outputs side by side, f32[T, sum of N], in one call (a layer's q,
    k and v: one wake-up of the threads, each streaming a contiguous part of all three). Where
    `jaxserve.kernels.cpu.enabled()`.

    `int8_dot` (ModelConfig.gguf_dot "int8"; the GGUF formats only) and up to INT8_DOT_MAX_ROWS
    rows: each row of x is first rounded to int8 per block of 32 (scale max|x| / 127, as
    llama.cpp's Q8_1) and each weight block meets it in an integer dot product
    (tests/test_cpu_kernels.py's `int8_reference` computes the same in numpy); else x stays f32
    and each weight is the f32 value `dequantize` gives (the int8 storage's rounded once)."""
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    call = jax.ffi.ffi_call(
        _QUANTIZED_TARGET,
        jax.ShapeDtypeStruct((x.shape[0], sum(b.shape[1] for b in ws)), jnp.float32))
    return call(x, jnp.asarray(layer, jnp.int32), *ws, format=np.int32(_FORMAT_CODES[fmt]),
                int8_dot=np.int32(int8_dot))


__all__ = ["BLOCK", "FORMATS", "INT8_DOT_MAX_ROWS", "WEIGHT_DTYPES", "dequantize",
           "quantized_matmul", "random_blocks", "row_bytes", "supports", "stacked_matmul"]

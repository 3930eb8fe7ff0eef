"""One layer's projection read in place from the stacked layers' weights, on the CPU, through a
C++ XLA FFI kernel (cpu/matmul.cc, in the CPU kernels' library: jaxserve.kernels.cpu.library).

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

_TARGET = "jaxserve_stacked_matmul"  # matmul.cc's JaxserveStackedMatmul
# The kernel's vector width divides its output columns: 16 floats covers AVX-512, AVX2 and SSE.
COLUMN_MULTIPLE = 16
MIN_ROWS, MAX_ROWS = 2, 512


def supports(num_rows: int, shapes: list[tuple[int, int]], dtype) -> bool:
    """Whether the kernel takes `num_rows` rows through f32 weights of these (K, N) shapes."""
    return (jnp.dtype(dtype) == jnp.float32 and MIN_ROWS <= num_rows <= MAX_ROWS
            and all(n % COLUMN_MULTIPLE == 0 for _, n in shapes))


def stacked_matmul(x, w, layer):
    """x f32[T, K] @ w[layer] for w f32[L, K, N] and a scalar layer index: f32[T, N]. Where
    `jaxserve.kernels.cpu.enabled()` and `supports`."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, jnp.asarray(layer, jnp.int32))


__all__ = ["supports", "stacked_matmul"]

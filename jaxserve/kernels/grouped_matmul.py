"""The experts' grouped matmul on the CPU, read in place from the sparse layers' stack, through a
C++ XLA FFI kernel (cpu/grouped_matmul.cc, in the CPU kernels' library:
jaxserve.kernels.cpu.library): one call per projection over every expert's rows, each expert
present read once (jaxserve/executor/models/moe.py uses it where `supports`).

XLA:CPU's own `ragged_dot` multiplies every row by every expert; the pure-JAX CPU path instead
loops over tiles of one expert's rows (moe.tiled_grouped_mlp), a loop step and a read of the
expert's weights per tile (measured: benchmarks/RESULTS.md, "Mixture of experts").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.matmul import COLUMN_MULTIPLE, WEIGHT_DTYPES

_TARGET = "jaxserve_grouped_matmul"  # grouped_matmul.cc's JaxserveGroupedMatmul


def supports(shapes: list[tuple[int, int]], dtype) -> bool:
    """Whether the kernel takes expert weights of these (K, N) shapes in `dtype` (f32 or bf16:
    jaxserve.kernels.matmul.WEIGHT_DTYPES)."""
    return jnp.dtype(dtype) in WEIGHT_DTYPES and all(n % COLUMN_MULTIPLE == 0 for _, n in shapes)


def grouped_matmul(x, w, layer, group_sizes):
    """x f32[R, K], its rows sorted by group (group_sizes i32[G] of them, in order), times their
    group's weights in layer `layer` of w f32 or bf16 [L, G, K, N] (bf16 widened exactly):
    f32[R, N], the rows past the groups zero. Where `jaxserve.kernels.cpu.enabled()` and
    `supports`."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[3]), jnp.float32))
    return call(x, w, jnp.asarray(layer, jnp.int32), jnp.asarray(group_sizes, jnp.int32))


def reference(x, w, layer, group_sizes):
    """`grouped_matmul` in float64 numpy: the oracle the kernel is tested against."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)[int(layer)]
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


__all__ = ["grouped_matmul", "reference", "supports"]

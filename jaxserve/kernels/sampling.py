"""The sampler's top-k and top-p thresholds on the CPU, through a C++ XLA FFI kernel
(cpu/sampling.cc, in the CPU kernels' library: jaxserve.kernels.cpu.library).

jaxserve/executor/sampler.py finds the thresholds elsewhere by bisection, 32 passes over [rows,
vocabulary]; on XLA:CPU each pass is a full read of the logits, which makes the bisection several
times slower than this kernel (measured: benchmarks/RESULTS.md, "The sampler's top-k and top-p on
the CPU"). The kernel's thresholds are exact: each row's kept set is the one a float64 reference
keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_TARGET = "jaxserve_sampling_thresholds"  # sampling.cc's JaxserveSamplingThresholds


def thresholds(scaled, top_k, top_p):
    """Per row of scaled logits f32[S, V], the threshold t f32[S] such that the row's values >= t
    are those top-k (top_k[r] > 0: the values >= the k-th largest finite one, ties kept) and then
    top-p (top_p[r] < 1: of those, the values >= the largest t whose values >= t weigh at least
    top_p of their softmax mass) keep; -inf where both filters are off. Where
    `jaxserve.kernels.cpu.enabled()`."""
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(scaled.shape[:1], jnp.float32))
    return call(scaled.astype(jnp.float32), top_k.astype(jnp.int32), top_p.astype(jnp.float32))


__all__ = ["thresholds"]

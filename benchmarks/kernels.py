"""Ragged paged attention benchmark: time per call, bandwidth and FLOP/s against measured peaks.

    python benchmarks/kernels.py [--check] [--sweep] [--out FILE]

--check first compares every implementation on this backend (the tuned XLA path and the kernel)
against the float64 reference on mixed batches (GQA with odd groups, sliding window, soft cap, f32
and bf16) and stops on a mismatch.
--sweep times a few GPU block configurations on each batch and reports the best.

Peaks are measured in the same run: a large device copy (read + write bytes / time) and a large
bf16 matmul. Bytes "needed" are the K/V the causal queries actually see plus q and out; FLOPs are
4 * Hq * D per (query, key) pair attended. Rows print as a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.kernels import attention as rpa  # noqa: E402
from jaxserve.kernels.attention import reference  # noqa: E402
from jaxserve.shapes import cdiv, kv_cache_shape  # noqa: E402


def timeit(fn, *args, iters=20, repeats=3):
    """Best of `repeats` of the mean over `iters` back-to-back calls: calls queue on the device as
    in a serving loop, so per-call host round trips do not count."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def measure_peaks(on_gpu, dtype=None):
    """(copy bytes/s, matmul FLOP/s); the matmul in `dtype` (default bf16 on GPU, f32 on CPU), on
    random data (zeros and ones can run faster than real data)."""
    n = (1 << 28) if on_gpu else (1 << 25)  # f32 elements: 1 GiB on GPU, 128 MiB on CPU
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 2.0)
    bw = 2 * x.nbytes / timeit(copy, x, iters=10)
    m = 8192 if on_gpu else 1024
    dtype = dtype or (jnp.bfloat16 if on_gpu else jnp.float32)
    a = jax.random.normal(jax.random.key(0), (m, m), dtype)
    mm = jax.jit(lambda a: a @ a)
    flops = 2 * m ** 3 / timeit(mm, a, iters=10)
    return bw, flops


def make_batch(rng, *, q_lens, kv_lens, Hq, Hkv, D, page_size, dtype):
    S = len(q_lens)
    need = [cdiv(n, page_size) for n in kv_lens]
    pages_per_seq = max(need)
    num_pages = 1 + sum(need)
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    page_indices = np.zeros((S, pages_per_seq), np.int32)
    at = 0
    for s, n in enumerate(need):
        page_indices[s, :n] = perm[at:at + n]
        at += n
    T = sum(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cache = jnp.asarray(rng.standard_normal(kv_cache_shape(num_pages, page_size, Hkv, D)), dtype)
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), dtype)
    return (q, cache, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray([S], jnp.int32))


def work(q_lens, kv_lens, Hq, Hkv, D, itemsize, kv_itemsize=None):
    pairs = sum(sum(kv - ql + i + 1 for i in range(ql)) for ql, kv in zip(q_lens, kv_lens))
    kv_bytes = sum(kv_lens) * 2 * Hkv * D * (kv_itemsize or itemsize)
    qo_bytes = 2 * sum(q_lens) * Hq * D * itemsize
    return kv_bytes + qo_bytes, 4 * Hq * D * pairs


# ---- comparison implementations (GPU) -----------------------------------------------------------

def dense_xla(q, kv_dense, kv_lens, sm_scale):
    """Attention over contiguous per-sequence K/V [S, L, 2Hkv, D]; queries grouped per sequence."""
    S, L, H2, D = kv_dense.shape
    Hkv, Hq = H2 // 2, q.shape[1]
    Tq = q.shape[0] // S
    qg = q.reshape(S, Tq, Hkv, Hq // Hkv, D)
    k, v = kv_dense[:, :, 0::2], kv_dense[:, :, 1::2]
    s = jnp.einsum("sqhgd,skhd->shgqk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    q_pos = kv_lens[:, None] - Tq + jnp.arange(Tq)[None]
    mask = jnp.arange(L)[None, None, :] <= q_pos[:, :, None]
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("shgqk,skhd->sqhgd", p, v).reshape(q.shape)


def jax_paged_decode(q, k_pages, v_pages, page_indices, kv_lens, sm_scale):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return paged_attention(q * sm_scale, k_pages, v_pages, page_indices, kv_lens,
                           pages_per_compute_block=8, k_splits=16)


# ---- correctness on the device ------------------------------------------------------------------

def check(impls):
    rng = np.random.default_rng(0)
    failed = False
    cases = [
        dict(q_lens=[1, 1, 37, 5], kv_lens=[300, 17, 100, 5], Hq=9, Hkv=3, D=64, page_size=16),
        dict(q_lens=[1] * 8, kv_lens=[2048, 1, 16, 17, 999, 64, 65, 700], Hq=32, Hkv=8, D=128,
             page_size=16),
        dict(q_lens=[130, 1, 64], kv_lens=[500, 2000, 64], Hq=8, Hkv=1, D=128, page_size=32),
    ]
    variants = [dict(), dict(sliding_window=50), dict(soft_cap=20.0)]
    for c in cases:
        for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 2e-2)):
            args = make_batch(rng, dtype=dtype, **c)
            for var in variants:
                kw = dict(sm_scale=c["D"] ** -0.5, **var)
                want = reference.ragged_paged_attention(*args, **kw)
                for impl in ("xla", *impls):
                    try:
                        got = jax.jit(functools.partial(rpa.ragged_paged_attention, impl=impl,
                                                        **kw))(*args).astype(jnp.float32)
                        err = float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())
                    except Exception as e:  # report, and go on to the next case
                        print(f"check {impl} {c} {var}: {type(e).__name__}: {str(e)[:300]}")
                        failed = True
                        continue
                    status = "ok" if err <= tol else "FAIL"
                    print(f"check {impl:10s} {jnp.dtype(dtype).name:8s} {c['q_lens']} "
                          f"{c['kv_lens']} Hq={c['Hq']} Hkv={c['Hkv']} {var}: rel err {err:.1e} "
                          f"{status}", flush=True)
                    failed |= status == "FAIL"
    return not failed


# ---- benchmark ----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    device = (jax.devices()[0].device_kind if on_gpu
              else f"CPU ({platform.processor() or 'host'}, {os.cpu_count()} cores)")
    kernels = ["pallas_gpu"] if on_gpu else ["cpu"]
    if a.check and kernels and not check(kernels):
        print("CHECK FAILED: benchmark numbers below are for a kernel that is wrong somewhere")

    bw_peak, flop_peak = measure_peaks(on_gpu)
    lines = [f"Device: {device}; JAX {jax.__version__}; measured peaks: copy "
             f"{bw_peak / 1e9:.0f} GB/s, matmul {flop_peak / 1e12:.1f} TFLOP/s "
             f"({'bf16 8192^3' if on_gpu else 'f32 1024^3'})", "",
             "| batch | impl | ms/call | GB/s needed | % peak BW | TFLOP/s | % peak FLOP/s |",
             "|---|---|---|---|---|---|---|"]
    if on_gpu:
        shape = dict(Hq=32, Hkv=8, D=128, page_size=16, dtype=jnp.bfloat16)
    else:  # SmolLM2-135M's attention shape in f32: the CPU serving path
        shape = dict(Hq=9, Hkv=3, D=64, page_size=16, dtype=jnp.float32)
    batches = {"decode 64 x 2k ctx": ([1] * 64, [2048] * 64),
               "verify 64 x 5 queries, 2k ctx": ([5] * 64, [2048] * 64),
               "prefill 4 x 512 chunk (+512 cached)": ([512] * 4, [1024] * 4)}
    rng = np.random.default_rng(0)
    for name, (q_lens, kv_lens) in batches.items():
        args = make_batch(rng, q_lens=q_lens, kv_lens=kv_lens, **shape)
        q, cache, kvl, pi, cu, ns = args
        D, Hq, Hkv = shape["D"], shape["Hq"], shape["Hkv"]
        itemsize = jnp.dtype(shape["dtype"]).itemsize
        nbytes, flops = work(q_lens, kv_lens, Hq, Hkv, D, itemsize)
        sm = D ** -0.5
        runs = {impl: (jax.jit(functools.partial(rpa.ragged_paged_attention, impl=impl,
                                                 sm_scale=sm)), args, nbytes)
                for impl in ("xla", *([] if on_gpu else ["cpu"]))}
        if not on_gpu and max(q_lens) <= 8:
            # Decodes and verifies over a bf16 cache (--kv-cache-dtype bfloat16): half the bytes.
            runs["cpu, bf16 cache"] = (runs["cpu"][0], (q, cache.astype(jnp.bfloat16), *args[2:]),
                                       work(q_lens, kv_lens, Hq, Hkv, D, itemsize, kv_itemsize=2)[0])
        if on_gpu:
            from jaxserve.kernels.attention import gpu
            configs = [dict()]
            if a.sweep and set(q_lens) == {1}:
                configs += [dict(tile_rows=t, num_splits=n, kv_block_tokens=k, num_stages=st)
                            for t in (16, 32) for n in (4, 16) for k in (64, 128) for st in (2, 3)]
            elif a.sweep:
                configs += [dict(tile_rows=t, kv_block_tokens=k, num_splits=1)
                            for t in (64, 128) for k in (32, 64, 128)]
            best = None
            for cfg in configs:
                fn = jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=sm, **cfg))
                try:
                    t = timeit(fn, *args)
                except Exception as e:  # a config Triton cannot compile (e.g. out of shared memory)
                    print(f"sweep {name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"sweep {name} {cfg or 'default'}: {t * 1e3:.3f} ms", flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg, fn)
            runs[f"pallas_gpu {best[1] or 'default'}"] = (best[2], args, nbytes)
            # Dense K/V laid out contiguously per sequence (the layout a non-paged server keeps).
            L = max(kv_lens)
            kv_dense = cache[pi].reshape(len(q_lens), -1, 2 * Hkv, D)[:, :L]
            if len(set(q_lens)) == 1:
                runs["dense XLA (contiguous KV)"] = (
                    jax.jit(functools.partial(dense_xla, sm_scale=sm)),
                    (q, kv_dense, kvl), nbytes)
            if set(q_lens) == {1}:
                k_pages = jnp.moveaxis(cache[:, :, 0::2], 2, 0)
                v_pages = jnp.moveaxis(cache[:, :, 1::2], 2, 0)
                runs["jax paged_attention (GPU, decode)"] = (
                    jax.jit(functools.partial(jax_paged_decode, sm_scale=sm)),
                    (q, k_pages, v_pages, pi, kvl), nbytes)
        for impl, (fn, fargs, fbytes) in runs.items():
            t = timeit(fn, *fargs, iters=20 if on_gpu else 3)
            lines.append(f"| {name} | {impl} | {t * 1e3:.3f} | {fbytes / t / 1e9:.1f} | "
                         f"{100 * fbytes / t / bw_peak:.0f}% | {flops / t / 1e12:.3f} | "
                         f"{100 * flops / t / flop_peak:.1f}% |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

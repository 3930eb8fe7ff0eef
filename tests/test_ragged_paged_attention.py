"""Ragged paged attention: every implementation (xla, cpu, the Pallas kernels in interpret mode)
against the float64 reference, jaxserve.kernels.attention.reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve.kernels import attention as rpa
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels.attention import cpu, reference
from jaxserve.kernels.cpu import library
from jaxserve.shapes import cdiv, kv_cache_shape

TOL = {"float32": 2e-3, "bfloat16": 2e-2}


def make_case(rng, *, q_lens, ctx_lens, page_size, Hq, Hkv, D, dtype, cache_dtype=None,
              pad_tokens=3, pad_seqs=2, pages_per_seq=None, num_pages=None):
    """A batch of sequences with random cached contexts; returns kernel args and the raw cache.
    The cache is `cache_dtype` (default `dtype`, the queries')."""
    kv_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [cdiv(n, page_size) for n in kv_lens]
    pages_per_seq = pages_per_seq or max(need) + 1
    num_pages = num_pages or 1 + sum(need) + 2
    # Pages dealt out shuffled so a sequence's pages are not contiguous; page 0 stays the null page.
    free = list(rng.permutation(np.arange(1, num_pages)))
    S = len(q_lens) + pad_seqs
    page_indices = np.zeros((S, pages_per_seq), np.int32)
    for s, n in enumerate(need):
        page_indices[s, :n] = [free.pop() for _ in range(n)]
    T = sum(q_lens) + pad_tokens
    cu = np.zeros(S + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = sum(q_lens)
    kv_lens_arr = np.zeros(S, np.int32)
    kv_lens_arr[:len(kv_lens)] = kv_lens
    cache = rng.standard_normal(kv_cache_shape(num_pages, page_size, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    cache, q = jnp.asarray(cache, cache_dtype or dtype), jnp.asarray(q, dtype)
    return (q, cache, jnp.asarray(kv_lens_arr), jnp.asarray(page_indices), jnp.asarray(cu),
            jnp.asarray([len(q_lens)], jnp.int32))


def padded_to_one_shape(q_lens_ctx_lens, page_size):
    """make_case's keyword arguments for each (q_lens, ctx_lens): every batch padded to the same
    tokens, sequences, page-table width and pool, so that one compiled program takes them all
    (the paths a batch takes are chosen at run time, from its live lengths)."""
    kv_pages = [[cdiv(c + q, page_size) for q, c in zip(*case)] for case in q_lens_ctx_lens]
    T = max(sum(q_lens) for q_lens, _ in q_lens_ctx_lens) + 3
    S = max(len(q_lens) for q_lens, _ in q_lens_ctx_lens) + 2
    shape = dict(pages_per_seq=max(map(max, kv_pages)) + 1,
                 num_pages=max(map(sum, kv_pages)) + 3, page_size=page_size)
    return [dict(q_lens=q_lens, ctx_lens=ctx_lens, pad_tokens=T - sum(q_lens),
                 pad_seqs=S - len(q_lens), **shape) for q_lens, ctx_lens in q_lens_ctx_lens]


@functools.cache
def _attention(impl, interpret, **kw):
    """One jitted function per implementation and static arguments, so that cases of one shape
    share its compiled program (cleared after the module: _free_programs)."""
    return jax.jit(functools.partial(rpa.ragged_paged_attention, impl=impl, interpret=interpret,
                                     **kw))


@pytest.fixture(scope="module", autouse=True)
def _free_programs():
    yield
    _attention.cache_clear()


def check(impl, args, *, dtype, sliding_window=None, soft_cap=None, interpret=False):
    q, cache, kv_lens, page_indices, cu, num_seqs = args
    D = q.shape[-1]
    kw = dict(sm_scale=D ** -0.5, sliding_window=sliding_window, soft_cap=soft_cap)
    fn = _attention(impl, interpret, **kw)
    got = np.asarray(fn(*args).astype(jnp.float32), np.float64)
    want = reference.ragged_paged_attention(*args, **kw)
    live = int(cu[int(num_seqs[0])])
    err = np.abs(got[:live] - want[:live]).max() / max(np.abs(want[:live]).max(), 1e-6)
    assert err <= TOL[dtype], f"{impl}: relative error {err:.2e} > {TOL[dtype]}"
    assert np.all(got[live:] == 0), "padding rows must come back as zeros"


# ---- the batch shapes hypothesis explores --------------------------------------------------------

# MHA, GQA (SmolLM2's 3 queries per KV head among them), MQA (8: the CPU kernel's largest group)
heads = st.sampled_from([(4, 4), (8, 2), (9, 3), (4, 1), (8, 1)])


@st.composite
def batches(draw, max_seqs=4, max_q=20, max_ctx=70):
    n = draw(st.integers(1, max_seqs))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    q_lens = [draw(st.sampled_from([1, 1, draw(st.integers(1, max_q))])) for _ in range(n)]
    ctx = [draw(st.integers(0, max_ctx)) for _ in range(n)]
    return dict(q_lens=q_lens, ctx_lens=ctx,
                page_size=draw(st.sampled_from([16, 32])),
                D=draw(st.sampled_from([64, 128])),
                dtype=dtype,
                # f32 queries over a bf16 cache: a model with kv_cache_dtype="bfloat16"
                cache_dtype=draw(st.sampled_from([dtype, "bfloat16"])),
                seed=draw(st.integers(0, 2**16)))


def run_case(impl, case, hq_hkv, *, sliding_window=None, soft_cap=None, interpret=False):
    case = dict(case)
    rng = np.random.default_rng(case.pop("seed"))
    dtype = case["dtype"]
    args = make_case(rng, Hq=hq_hkv[0], Hkv=hq_hkv[1], **case)
    check(impl, args, dtype=dtype, sliding_window=sliding_window, soft_cap=soft_cap,
          interpret=interpret)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@settings(max_examples=20, deadline=None)
@given(case=batches(), hq_hkv=heads,
       sliding_window=st.sampled_from([None, None, 1, 7, 40]),
       soft_cap=st.sampled_from([None, None, 5.0]))
def test_matches_the_reference(impl, case, hq_hkv, sliding_window, soft_cap):
    # cpu: decodes and short queries through the C++ kernel (f32 queries, f32 or bf16 cache),
    # chunks and bf16 queries through the XLA path. The reference reads the bf16 cache's values,
    # so f32 queries keep the f32 tolerance over either cache.
    run_case(impl, case, hq_hkv, sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_long_context_crosses_kv_blocks(impl):
    # Contexts longer than one KV block (xla.*_KV_BLOCK_TOKENS) and a prefill longer than
    # one query block exercise the loops' bounds, on the prefill path and on the decode-only one;
    # nine decodes of mixed lengths fill more than two groups of the decode path, the last one
    # partly, with a chunk among them; five short queries (speculative verify rows, 2-8
    # queries) fill more than one group of theirs, beside decodes and a chunk, and then without
    # the chunk (the cpu path's kernel-only branch). All six padded to one shape: two compiled
    # programs (with and without the window) instead of twelve.
    rng = np.random.default_rng(0)
    nine = ([1] * 4 + [30] + [1] * 5, [70, 5, 600, 129, 40, 0, 64, 65, 300, 1])
    verify = ([5, 1, 8, 2, 30, 3, 1, 6], [600, 70, 130, 63, 40, 0, 300, 64])
    verify_only = ([n for n in verify[0] if n <= 8], [c for n, c in zip(*verify) if n <= 8])
    cases = (([1, 45, 1], [600, 300, 0]), ([1, 1, 1], [600, 130, 63]), nine,
             ([1] * 9, nine[1][:9]), verify, verify_only)
    for case in padded_to_one_shape(cases, page_size=16):
        args = make_case(rng, **case, Hq=4, Hkv=2, D=64, dtype="float32")
        check(impl, args, dtype="float32")
        check(impl, args, dtype="float32", sliding_window=100)
    # Windows shorter than a verify's queries, and pages smaller than the CPU kernel's prefetch
    # distance.
    for page_size in (2, 16):
        args = make_case(rng, q_lens=verify_only[0], ctx_lens=verify_only[1], page_size=page_size,
                         Hq=9, Hkv=3, D=64, dtype="float32")
        check(impl, args, dtype="float32", sliding_window=3)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_cpu_path_runs_decodes_and_verifies_in_the_kernel(cache_dtype):
    # A batch of decodes and verifies only: the cpu path's program calls the kernel (a shape it
    # refused would pass the numeric tests on the XLA path alone).
    rng = np.random.default_rng(1)
    args = make_case(rng, q_lens=[5, 1, 8], ctx_lens=[40, 70, 3], page_size=16, Hq=9, Hkv=3, D=64,
                     dtype="float32", cache_dtype=cache_dtype)
    assert cpu.supports(args[0], args[1]) and cpu_kernels.enabled()
    run = {impl: jax.jit(functools.partial(rpa.ragged_paged_attention, impl=impl, sm_scale=0.125))
           for impl in ("cpu", "xla")}
    assert cpu._TARGET in run["cpu"].lower(*args).as_text()
    # Outside the contract (kv_len < q_len: the first queries sit before position 0 and see
    # nothing), the kernel still answers as the XLA path and the reference do, zeros for those
    # queries.
    args = (args[0], args[1], args[2].at[0].set(3)) + args[3:]  # 5 queries, 3 tokens
    got, want = (np.asarray(run[impl](*args)) for impl in ("cpu", "xla"))
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got, reference.ragged_paged_attention(*args, sm_scale=0.125),
                               atol=1e-5)
    assert not got[:2].any()


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_write_kv_round_trip(impl, cache_dtype):
    # cpu: a bf16 cache is written by the kernel library, rounded as XLA's convert rounds.
    rng = np.random.default_rng(1)
    P, ps, Hkv, D, T = 6, 16, 2, 64, 6
    cache = jnp.zeros(kv_cache_shape(P, ps, Hkv, D), cache_dtype)
    k = jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.float32)
    slots = jnp.asarray([17, 18, 40, 95, 3, P * ps], jnp.int32)  # the last is dropped
    write = functools.partial(rpa.write_kv, impl=impl)
    out = jax.jit(write, donate_argnums=0)(cache, k, v, slots)
    assert out.dtype == cache_dtype
    flat = np.asarray(out.astype(jnp.float32)).reshape(P * ps, 2 * Hkv, D)
    live = np.asarray(slots)[:-1]
    rounded = lambda x: np.asarray(x[:-1].astype(cache_dtype).astype(jnp.float32))
    np.testing.assert_array_equal(flat[live][:, 0::2], rounded(k))
    np.testing.assert_array_equal(flat[live][:, 1::2], rounded(v))
    untouched = np.setdiff1d(np.arange(P * ps), live)
    assert not flat[untouched].any()


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_cpu_write_kv_rounds_as_xla_converts(cache_dtype):
    # The library's write (both of its element types) against XLA's scatter and convert, on the
    # values where rounding goes wrong: the largest finite f32 (to inf in bf16), ties to even
    # either way, a value just under a tie, infinities, NaN.
    bits = np.array([0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F800000, 0xFF800000,
                     0x7FC00000, 0xC0490FDB], np.uint32)
    k = jnp.asarray(bits.view(np.float32).reshape(1, 1, 8))
    cache = jnp.zeros((2, 2, 2, 8), cache_dtype)
    slots = jnp.asarray([3], jnp.int32)
    got, want = (np.asarray(jax.jit(write)(cache, k, -k, slots))
                 for write in (cpu.write_kv, rpa.xla.write_kv))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    uint = np.uint16 if cache_dtype == "bfloat16" else np.uint32
    np.testing.assert_array_equal(got.view(uint)[ok], want.view(uint)[ok])


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_write_kv_in_place_in_a_loop_carry(cache_dtype):
    # The model writes each layer's K/V inside a scan over layers: the compiled program must not
    # copy the cache (no extra buffer of the cache's size beyond the donated argument). A bf16
    # cache through XLA's scatter would be widened to f32 around it, twice the cache's size.
    cache = jnp.zeros((64, 16, 4, 64), cache_dtype)
    k = jnp.ones((4, 2, 64), jnp.float32)

    def step(c, i):
        return rpa.write_kv(c, k, k, jnp.arange(4, dtype=jnp.int32) + i * 16), None

    f = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(8))[0], donate_argnums=0)
    mem = f.lower(cache).compile().memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < cache.nbytes // 2


@pytest.mark.parametrize("bad, msg", [
    (dict(Hq=6, Hkv=4), "not a multiple"),
    (dict(D_cache=32), "head_dim differs"),
])
def test_bad_shapes_raise_clear_errors(bad, msg):
    Hq, Hkv = bad.get("Hq", 4), bad.get("Hkv", 2)
    q = jnp.zeros((4, Hq, 64))
    cache = jnp.zeros(kv_cache_shape(4, 16, Hkv, bad.get("D_cache", 64)))
    with pytest.raises(ValueError, match=msg):
        rpa.ragged_paged_attention(q, cache, jnp.zeros(2, jnp.int32), jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros(3, jnp.int32), jnp.zeros(1, jnp.int32), sm_scale=0.1)


def test_page_indices_out_of_range_raise_when_concrete():
    with pytest.raises(ValueError, match="cache has 4 pages"):
        rpa.ragged_paged_attention(jnp.zeros((4, 4, 64)), jnp.zeros((4, 16, 4, 64)),
                                   np.zeros(2, np.int32), np.full((2, 3), 4, np.int32),
                                   np.zeros(3, np.int32), np.zeros(1, np.int32), sm_scale=0.1)


def test_unknown_impl_raises():
    args = make_case(np.random.default_rng(2), q_lens=[1], ctx_lens=[3], page_size=16, Hq=2,
                     Hkv=1, D=64, dtype="float32")
    with pytest.raises(ValueError, match="impl="):
        rpa.ragged_paged_attention(*args, sm_scale=0.1, impl="cuda")


@pytest.mark.parametrize("attend", [rpa.ragged_paged_attention,
                                    reference.ragged_paged_attention])
def test_sinks_of_the_wrong_shape_are_a_clear_error(attend):
    args = make_case(np.random.default_rng(2), q_lens=[1], ctx_lens=[3], page_size=16, Hq=2,
                     Hkv=1, D=64, dtype="float32")
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head \[2\]"):
        attend(*args, sm_scale=0.1, sinks=jnp.zeros(3))


def test_the_reference_s_sinks_are_hf_s():
    # gpt-oss in transformers: the sink joins each row's logits, the softmax runs over both, the
    # sink's column is dropped. One sequence, pages in order, 3 queries after 4 cached tokens.
    rng = np.random.default_rng(7)
    args = make_case(rng, q_lens=[3], ctx_lens=[4], page_size=4, Hq=2, Hkv=1, D=64,
                     dtype="float32", pad_tokens=0, pad_seqs=0)
    sinks = np.array([3.0, -1.0])
    got = reference.ragged_paged_attention(*args, sm_scale=0.125, sinks=sinks)
    q, cache, _, page_indices, _, _ = (np.asarray(a, np.float64) for a in args)
    kv = cache[page_indices[0, :2].astype(int)].reshape(-1, 2, 64)[:7]
    for i in range(3):
        for h in range(2):
            logits = np.append(kv[:5 + i, 0] @ q[i, h] * 0.125, sinks[h])
            p = np.exp(logits - logits.max())
            p = (p / p.sum())[:-1]
            np.testing.assert_allclose(got[i, h], p @ kv[:5 + i, 1], atol=1e-12)


@pytest.mark.parametrize("impl", ["xla", "cpu", "pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_sinks_match_the_reference(impl, sliding_window):
    # Decodes, a short query and a chunk in one batch; sinks large and small against the scores,
    # one beside a query that sees one key. The Pallas kernels in interpret mode.
    rng = np.random.default_rng(8)
    args = make_case(rng, q_lens=[1, 4, 20, 1], ctx_lens=[30, 9, 3, 0], page_size=16, Hq=4,
                     Hkv=2, D=64, dtype="float32")
    sinks = jnp.asarray([4.0, -2.0, 0.5, 0.0])
    kw = dict(sm_scale=0.125, sliding_window=sliding_window, sinks=sinks)
    got = np.asarray(jax.jit(functools.partial(rpa.ragged_paged_attention, impl=impl, **kw,
                                               interpret=impl.startswith("pallas")))(*args))
    want = reference.ragged_paged_attention(*args, **kw)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert not np.allclose(want, reference.ragged_paged_attention(
        *args, sm_scale=0.125, sliding_window=sliding_window), atol=1e-2)  # the sinks bind


def test_the_reference_is_plain_causal_attention():
    # One sequence whose pages are in order, 5 new queries after 7 cached tokens, against a
    # softmax written out here per query and head (GQA: 2 query heads per KV head).
    rng = np.random.default_rng(6)
    args = make_case(rng, q_lens=[5], ctx_lens=[7], page_size=4, Hq=4, Hkv=2, D=64,
                     dtype="float32", pad_tokens=0, pad_seqs=0)
    q, cache, _, page_indices, _, _ = (np.asarray(a, np.float64) for a in args)
    kv = cache[page_indices[0, :3].astype(int)].reshape(-1, 4, 64)[:12]
    want = np.zeros((5, 4, 64))
    for i in range(5):
        for h in range(4):
            k, v = kv[:8 + i, 2 * (h // 2)], kv[:8 + i, 2 * (h // 2) + 1]
            p = np.exp(k @ q[i, h] * 0.125)
            want[i, h] = p @ v / p.sum()
    np.testing.assert_allclose(reference.ragged_paged_attention(*args, sm_scale=0.125), want,
                               rtol=1e-12)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="auto picks a kernel off CPU")
def test_auto_picks_the_cpu_path_and_its_kernel_builds():
    # The suite's machines have a C++ compiler: the kernel must build there, or every decode
    # test above would pass on the XLA path alone.
    assert rpa.auto_impl() == "cpu"
    assert cpu_kernels.enabled()


def test_cpu_kernel_falls_back_to_the_xla_path_without_a_compiler(tmp_path, monkeypatch,
                                                                  caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path))
    library.load.cache_clear()
    _attention.cache_clear()  # traced afresh: the kernels' switch is read when tracing
    try:
        assert not cpu_kernels.enabled()
        assert cpu_kernels.why_off().startswith("no C++ compiler")
        assert "CPU kernels unavailable" in caplog.text
        args = make_case(np.random.default_rng(5), q_lens=[1, 1, 9], ctx_lens=[40, 3, 20],
                         page_size=16, Hq=4, Hkv=2, D=64, dtype="float32")
        check("cpu", args, dtype="float32")
    finally:
        library.load.cache_clear()  # the next caller builds (or finds) the real kernel again
        _attention.cache_clear()


# ---- Pallas kernels in interpret mode (slow on CPU: few, small examples) -------------------------

@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@settings(max_examples=6, deadline=None)
@given(case=batches(max_seqs=3, max_q=12, max_ctx=40), hq_hkv=heads,
       sliding_window=st.sampled_from([None, 5]), soft_cap=st.sampled_from([None, 5.0]))
def test_pallas_interpret_matches_the_reference(impl, case, hq_hkv, sliding_window, soft_cap):
    run_case(impl, case, hq_hkv, sliding_window=sliding_window, soft_cap=soft_cap, interpret=True)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_pallas_interpret_mixed_batch_with_odd_group(impl):
    # SmolLM2's shape class: 3 query heads per KV head (padded to 4 inside the GPU kernel), a
    # decode, a chunk continuing a cached prefix across several KV blocks, and a fresh prompt.
    rng = np.random.default_rng(3)
    args = make_case(rng, q_lens=[1, 20, 7], ctx_lens=[90, 70, 0], page_size=16, Hq=6, Hkv=2,
                     D=64, dtype="float32")
    check(impl, args, dtype="float32", interpret=True)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_kernel_kv_splits_merge_exactly(num_splits):
    # Splitting each item's KV range across programs (merged by log-sum-exp) must not change the
    # result, including splits that get no KV block (the 5-token sequence) and a sliding window.
    from jaxserve.kernels.attention import gpu

    rng = np.random.default_rng(4)
    args = make_case(rng, q_lens=[1, 9, 1], ctx_lens=[200, 60, 4], page_size=16, Hq=4, Hkv=2,
                     D=64, dtype="float32")
    q, cache, kv_lens, page_indices, cu, num_seqs = args
    kw = dict(sm_scale=0.125, sliding_window=150)
    got = gpu.ragged_paged_attention(*args, **kw, interpret=True, num_splits=num_splits)
    want = reference.ragged_paged_attention(*args, **kw)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-3 * np.abs(want).max())
    sinks = jnp.asarray([1.5, -1.0, 0.0, 3.0])  # merged, then scaled by each head's sink
    got = gpu.ragged_paged_attention(*args, **kw, sinks=sinks, interpret=True,
                                     num_splits=num_splits)
    want = reference.ragged_paged_attention(*args, **kw, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-3 * np.abs(want).max())

"""The on-device sampler (jaxserve.executor.sampler), against numpy references."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.config import MAX_LOGPROBS
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.executor.sampler import (_apply_penalties, _argmax, make_sampling_metadata, sample,
                                       top_logprobs_width)
from jaxserve.executor.sampling_rows import SamplingRow

EOS = (1,)
sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "all_greedy"))


def _row(seed=0, prompt=(5, 6), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(max_tokens=None, **params), seed, list(prompt), list(output))


def _run(logits, rows, num_rows_padded=None, num_top_logprobs=0, **kw):
    md = make_sampling_metadata(rows, num_rows_padded or len(rows), eos_token_ids=EOS, **kw)
    return jax.tree.map(np.asarray, sample_jit(np.asarray(logits, np.float32), md,
                                               num_top_logprobs=num_top_logprobs))


def _logits(S, V, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(size=(S, V)).astype(np.float32) * scale


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    logits = _logits(6, 1000)
    out = _run(logits, [_row(temperature=0)] * 5, num_rows_padded=6,
               num_top_logprobs=MAX_LOGPROBS)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))  # padding row greedy too
    ref = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(6), logits.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-logits, -1)[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, -1)[:, ::-1][:, :MAX_LOGPROBS],
                               atol=1e-5)


@pytest.mark.parametrize("V", [1000, 49152, 50257, 151936, 7])
def test_blockwise_argmax_is_numpys_first_maximum(V):
    # Widths a block divides (1000, 49152, 151936), one padded to blocks (50257 is 29 x 1733),
    # and one narrower than a block; ties across and within blocks keep the first index.
    x = _logits(6, V, seed=V)
    x[1, V // 2] = x[1, V - 1] = 50.0  # tie in different blocks
    x[2, :] = -np.inf  # every token blocked: index 0, as jnp.argmax
    x[3, -1] = 60.0  # in the last (possibly padded) block
    x[4, min(3, V - 1)] = x[4, min(4, V - 1)] = 70.0  # tie in one block
    np.testing.assert_array_equal(np.asarray(jax.jit(_argmax)(x)), x.argmax(-1))


def test_all_greedy_program_matches_the_general_one():
    # The runner's variant for all-greedy steps compiles the draw out: same tokens and logprobs,
    # with penalties, min_tokens and top logprobs in play.
    logits = _logits(5, 700, seed=3)
    rows = [_row(temperature=0), _row(temperature=0, output=[9, 9], repetition_penalty=1.3,
                                      frequency_penalty=0.5),
            _row(temperature=0, min_tokens=3, output=[4]), None]
    md = make_sampling_metadata(rows, 5, eos_token_ids=EOS, history_buckets=(8,))
    general, greedy = (
        jax.tree.map(np.asarray, sample_jit(logits, md, num_top_logprobs=MAX_LOGPROBS,
                                            all_greedy=g)) for g in (False, True))
    jax.tree.map(np.testing.assert_array_equal, general, greedy)


def test_sampled_logprob_is_of_the_raw_distribution():
    logits = _logits(4, 300, seed=1)
    out = _run(logits, [_row(seed=i, temperature=0.5, repetition_penalty=1.5, top_k=10)
                        for i in range(4)])
    np.testing.assert_allclose(out.logprobs, _log_softmax(logits)[np.arange(4), out.token_ids],
                               atol=1e-5)
    assert out.top_token_ids.shape == (4, 0)


def test_top_logprobs_width():
    assert top_logprobs_width([None, _row()]) == 0
    assert top_logprobs_width([_row(logprobs=0)]) == 0  # the sampled logprob always comes
    assert top_logprobs_width([_row(), _row(logprobs=2)]) == MAX_LOGPROBS


def test_seeded_sampling_ignores_batch_composition_and_row_position():
    V = 500
    target = _logits(1, V, seed=7)[0]
    mine = [_row(seed=1234, temperature=0.9, output=[3] * step) for step in range(3)]
    others = [_row(seed=9, temperature=1.3, top_p=0.8, presence_penalty=1.0, prompt=range(40)),
              _row(temperature=0), None, _row(seed=5, top_k=4, min_p=0.1, min_tokens=9)]
    for step, row in enumerate(mine):
        alone = _run(target[None], [row]).token_ids[0]
        logits = _logits(8, V, seed=step)
        logits[2] = target
        mixed = _run(logits, others[:2] + [row] + others[2:], num_rows_padded=8).token_ids[2]
        assert alone == mixed, step
    # Both the seed and the step change the draw.
    by_seed = _run(np.repeat(target[None], 8, 0), [_row(seed=s, temperature=0.9) for s in range(8)])
    by_step = _run(np.repeat(target[None], 8, 0),
                   [_row(seed=1234, temperature=0.9, output=[3] * n) for n in range(8)])
    assert len(set(by_seed.token_ids)) > 1 and len(set(by_step.token_ids)) > 1


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(16, 2000, seed=3, scale=1.0)
    rows = [_row(seed=i, temperature=1.5, top_k=1) for i in range(8)]
    rows += [_row(seed=i, temperature=1.5, top_p=1e-6) for i in range(8)]
    np.testing.assert_array_equal(_run(logits, rows).token_ids, logits.argmax(-1))


def _draws(logits_row, params, n=20000, **row):
    """n draws from one distribution: one row per seed, all in one batch."""
    out = _run(np.repeat(np.asarray(logits_row, np.float32)[None], n, 0),
               [_row(seed=s, **row, **params) for s in range(n)])
    return np.bincount(out.token_ids, minlength=len(logits_row))


def _assert_matches(counts, probs):
    """Pearson chi-square over the tokens with positive probability; no draws elsewhere.
    The bound is the 1e-4 upper quantile (Wilson-Hilferty), so a correct sampler fails ~never."""
    probs = np.asarray(probs, np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, np.nonzero(counts * ~support)
    n = counts.sum()
    expected = n * probs[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    df = support.sum() - 1
    if df == 0:
        return
    bound = df * (1 - 2 / (9 * df) + 3.719 * np.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, (chi2, bound, counts, expected)


def _softmax(x):
    return np.exp(_log_softmax(x))


def _filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Numpy reference of the filters: sort, cut, renormalise."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    keep[order[:top_k if top_k > 0 else len(x)]] = True
    p = np.where(keep, _softmax(np.where(keep, x, -np.inf)), 0)
    cum_before = np.cumsum(p[order]) - p[order]
    keep[order[cum_before >= top_p]] = False
    p = np.where(keep, p, 0)
    keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0)
    return p / p.sum()


LOGITS8 = np.array([2.0, 1.5, 0.3, -0.4, 1.0, -2.0, 0.0, 0.7])


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=2.0), dict(top_k=3),
    dict(top_p=0.7), dict(top_p=0.9, temperature=0.5), dict(min_p=0.3),
    dict(top_k=5, top_p=0.8, min_p=0.2, temperature=1.4)])
def test_empirical_distribution_matches_filtered_softmax(params):
    _assert_matches(_draws(LOGITS8, params), _filtered_probs(LOGITS8, **params))


def test_distribution_across_vocabulary_blocks():
    """Likely tokens on both sides of the 256-token block edges, in a partial last block."""
    V, hot = 2000, [0, 255, 256, 511, 700, 1023, 1024, 1500, 1998, 1999]
    logits = np.full(V, -30.0, np.float32)
    logits[hot] = np.linspace(-1.0, 1.5, len(hot))
    counts, probs = _draws(logits, dict(temperature=0.8)), _softmax(logits / 0.8)
    rest = np.ones(V, bool)
    rest[hot] = False
    group = lambda a: np.append(a[hot], a[rest].sum())
    _assert_matches(group(counts), group(probs))


def test_large_vocabulary_keeps_each_blocks_mass():
    logits = _logits(1, 49152, seed=11, scale=2.0)[0]  # SmolLM2's vocabulary size
    counts = _draws(logits, dict(temperature=1.0), n=1024)
    by_group = lambda a: a.reshape(16, -1).sum(-1)
    _assert_matches(by_group(counts), by_group(_softmax(logits)))


def _np_penalties(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    x = np.array(logits, np.float32)
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / np.float32(repetition),
                       x[seen] * np.float32(repetition))
    counts = np.bincount(np.asarray(output, int), minlength=len(x)).astype(np.float32)
    return x - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)


def test_penalties_match_numpy():
    V = 64
    logits = _logits(4, V, seed=5)
    rows = [_row(prompt=[3, 4, 4, 9], output=[9, 9, 10, 3], repetition_penalty=1.3),
            _row(prompt=[1], output=[2, 2, 2, 5], presence_penalty=0.5, frequency_penalty=-0.7),
            _row(prompt=[7, 8], output=[8, 63], presence_penalty=-1.0, frequency_penalty=2.0,
                 repetition_penalty=0.8),
            _row(prompt=[11, 12], output=[12])]  # no penalties: untouched
    md = make_sampling_metadata(rows, 4, eos_token_ids=EOS)
    assert md.history_token_ids.shape == (4, 8)
    got = np.asarray(jax.jit(_apply_penalties)(logits, md))
    for i, r in enumerate(rows):
        p = r.params
        want = _np_penalties(logits[i], r.prompt_token_ids, r.output_token_ids,
                             p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(got[3], logits[3])


def test_penalties_steer_greedy_and_sampled_rows():
    logits = np.zeros((2, 8), np.float32)
    logits[:, 2], logits[:, 4] = 3.0, 2.9
    rows = [_row(temperature=0, prompt=[2], repetition_penalty=1.2),
            _row(temperature=0, output=[2], presence_penalty=0.2)]
    assert list(_run(logits, rows).token_ids) == [4, 4]
    penalised = _np_penalties(LOGITS8, [0], [0, 0, 1], 0.3, 0.4, 1.5)
    params = dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.5)
    _assert_matches(_draws(LOGITS8, params, prompt=[0], output=[0, 0, 1]), _softmax(penalised))


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = np.zeros((5, 16), np.float32)
    logits[:, EOS[0]], logits[:, 7], logits[:, 3] = 5.0, 4.0, 3.0
    rows = [_row(temperature=0, min_tokens=2, stop_token_ids=[7]),
            _row(temperature=0, min_tokens=2, stop_token_ids=[7], output=[4, 4]),
            _row(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[7]),
            _row(temperature=0, min_tokens=2)]
    assert list(_run(logits, rows, num_rows_padded=5).token_ids) == [3, 1, 1, 7, 1]
    sampled = _draws(logits[0], dict(min_tokens=3, stop_token_ids=[7]), n=2000)
    assert sampled[EOS[0]] == sampled[7] == 0 and sampled.sum() == 2000


def test_metadata_padding_and_history_buckets():
    rows = [None, _row(seed=2**40 + 3, output=[1, 2], temperature=0.5, repetition_penalty=1.1)]
    md = make_sampling_metadata(rows, 4, eos_token_ids=(0, 1), history_buckets=(8, 32))
    assert md.history_token_ids.shape == (4, 8) and md.blocked_token_ids.shape == (4, 66)
    assert list(md.history_token_ids[1]) == [5, 6, 1, 2, -1, -1, -1, -1]
    assert list(md.num_prompt_tokens) == [0, 2, 0, 0] and list(md.steps) == [0, 2, 0, 0]
    assert list(md.seeds[1]) == [2**8, 3] and list(md.temperature) == [0, 0.5, 0, 0]
    assert (md.history_token_ids[[0, 2, 3]] == -1).all() and (md.blocked_token_ids == -1).all()
    plain = make_sampling_metadata([_row(), None], 2, eos_token_ids=EOS)
    assert plain.history_token_ids.shape == (2, 0)
    with pytest.raises(ValueError, match="history bucket"):
        make_sampling_metadata([_row(prompt=range(40), frequency_penalty=1.0)], 1,
                               eos_token_ids=EOS, history_buckets=(8, 32))
    with pytest.raises(ValueError, match="exceed"):
        make_sampling_metadata([_row()] * 3, 2, eos_token_ids=EOS)


def test_metadata_signature_depends_only_on_penalty_use():
    """One compiled sampler per (rows, history width, top-logprobs width): request parameters
    other than penalties never change a shape or dtype."""
    signature = lambda rows: jax.tree.map(  # noqa: E731
        lambda a: (a.shape, a.dtype), make_sampling_metadata(rows, 4, eos_token_ids=EOS))
    plain = signature([_row(temperature=0)])
    for rows in ([_row(top_k=3, top_p=0.5, min_p=0.1, seed=7)], [None, _row(min_tokens=4)] * 2,
                 [_row(temperature=0, top_k=5, stop_token_ids=list(range(64)), min_tokens=1)]):
        assert signature(rows) == plain
    greedy = make_sampling_metadata([_row(temperature=0, top_k=5, top_p=0.5)], 1,
                                    eos_token_ids=EOS)
    assert (greedy.top_k[0], greedy.top_p[0]) == (0, 1)  # filters off: they never move the argmax


def test_bfloat16_logits():
    logits = _logits(3, 100, seed=2).astype(jax.numpy.bfloat16)
    out = _run(logits.astype(np.float32), [_row(temperature=0)] * 3)
    md = make_sampling_metadata([_row(temperature=0)] * 3, 3, eos_token_ids=EOS)
    bf = sample_jit(jax.numpy.asarray(logits), md)
    np.testing.assert_array_equal(np.asarray(bf.token_ids), out.token_ids)

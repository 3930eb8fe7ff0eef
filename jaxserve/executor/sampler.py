"""The device sampler: per-row metadata for one step (numpy, host side) and `sample`, the pure,
jitted draw of one token per row.

The runner compiles `sample` per row bucket and per static width of the optional inputs: the
penalty history (0 unless a row uses penalties) and the top logprobs (0 or MAX_LOGPROBS), so a
step pays only for what its rows use. Structured outputs are a separate step before it,
`apply_token_bitmask`, run only in steps with a constrained row. The rows come in as
`jaxserve.executor.sampling_rows.SamplingRow`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.config import MAX_LOGPROBS
from jaxserve.executor.batch_plan import next_power_of_two
from jaxserve.executor.sampling_rows import MAX_STOP_TOKEN_IDS, SAMPLING_EPS, SamplingRow
from jaxserve.kernels import cpu as cpu_kernels
from jaxserve.kernels import sampling as cpu_sampling
from jaxserve.shapes import cdiv

# ---------------------------------------------------------------------------------------------
# Host side: per-row metadata for one step (numpy only; the runner transfers it as one pytree).


class SamplingMetadata(NamedTuple):
    """Per-row sampling inputs for S rows. Padding rows are greedy with every filter off.

    The two widths are static shapes chosen host-side: `blocked_token_ids` is always
    len(eos) + MAX_STOP_TOKEN_IDS wide; `history_token_ids` is 0 wide unless a row uses penalties,
    which compiles the penalty path only for steps that need it.
    """

    temperature: np.ndarray  # f32[S]; < SAMPLING_EPS is greedy
    top_k: np.ndarray  # i32[S]; <= 0 is off
    top_p: np.ndarray  # f32[S]; 1 is off
    min_p: np.ndarray  # f32[S]; 0 is off
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    seeds: np.ndarray  # u32[S, 2]: threefry key data (high, low 32 bits of the 64-bit seed)
    steps: np.ndarray  # u32[S]: tokens the sequence has generated so far
    blocked_token_ids: np.ndarray  # i32[S, B], -1 padded: EOS/stop ids held back by min_tokens
    history_token_ids: np.ndarray  # i32[S, H], -1 padded: prompt then output tokens
    num_prompt_tokens: np.ndarray  # i32[S]: where the output starts in history_token_ids


def blocked_width(eos_token_ids: Sequence[int]) -> int:
    return len(eos_token_ids) + MAX_STOP_TOKEN_IDS


def top_logprobs_width(rows: Sequence[SamplingRow | None]) -> int:
    """The static `num_top_logprobs` for a step: 0 or MAX_LOGPROBS, so at most two variants; the
    engine keeps each row's first params.logprobs columns."""
    return MAX_LOGPROBS if any(r is not None and r.params.logprobs for r in rows) else 0


def make_sampling_metadata(rows: Sequence[SamplingRow | None], num_rows_padded: int, *,
                           eos_token_ids: Sequence[int],
                           history_buckets: Sequence[int] = ()) -> SamplingMetadata:
    """Numpy metadata for `sample`. A None row (a prefill chunk that does not sample yet) and the
    rows past len(rows) are padding. `history_buckets` are the warmed penalty-history widths
    (sorted); without them the width is the next power of two."""
    if len(rows) > num_rows_padded:
        raise ValueError(f"{len(rows)} rows exceed the padded count {num_rows_padded}")
    S = num_rows_padded
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    presence = np.zeros(S, np.float32)
    frequency = np.zeros(S, np.float32)
    repetition = np.ones(S, np.float32)
    seeds = np.zeros((S, 2), np.uint32)
    steps = np.zeros(S, np.uint32)
    blocked = np.full((S, blocked_width(eos_token_ids)), -1, np.int32)
    num_prompt = np.zeros(S, np.int32)
    penalised = [i for i, r in enumerate(rows) if r is not None and r.params.uses_penalties]
    need = max((len(rows[i].prompt_token_ids) + len(rows[i].output_token_ids) for i in penalised),
               default=0)
    history = np.full((S, _history_width(need, history_buckets) if penalised else 0), -1, np.int32)
    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        if not p.is_greedy:  # greedy rows leave the filters off: they never move the argmax
            temperature[i] = p.temperature
            top_k[i], top_p[i], min_p[i] = p.top_k, p.top_p, p.min_p
        presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
        repetition[i] = p.repetition_penalty
        seed = row.seed % 2**64
        seeds[i] = (seed >> 32, seed & 0xFFFFFFFF)
        steps[i] = len(row.output_token_ids)
        if len(row.output_token_ids) < p.min_tokens:
            ids = p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *eos_token_ids)
            blocked[i, :len(ids)] = ids
    for i in penalised:
        row = rows[i]
        n = len(row.prompt_token_ids)
        num_prompt[i] = n
        history[i, :n] = row.prompt_token_ids
        history[i, n:n + len(row.output_token_ids)] = row.output_token_ids
    return SamplingMetadata(temperature, top_k, top_p, min_p, presence, frequency, repetition,
                            seeds, steps, blocked, history, num_prompt)


def _history_width(need: int, buckets: Sequence[int]) -> int:
    if not buckets:
        return next_power_of_two(max(need, 1))
    for b in buckets:
        if b >= need:
            return b
    raise ValueError(f"a penalised row holds {need} tokens, beyond the largest history bucket "
                     f"{buckets[-1]}")


# ---------------------------------------------------------------------------------------------
# Device side: pure and jittable; every row independent of the others.


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: of the sampled token
    top_token_ids: jax.Array  # i32[S, K]
    top_logprobs: jax.Array  # f32[S, K]


# The inverse-CDF draw works on blocks of the vocabulary: a block by its mass, then a token in it.
# Each level's running sum stays short (V / 256 and 256 terms), so f32 rounding moves any token's
# probability by ~1e-7 of its block's mass instead of ~1e-7 absolute as one cumsum over V would.
_BLOCK = 256
# Bisection steps for the top-k / top-p thresholds: enough to separate adjacent f32 logits.
_BISECT_STEPS = 32


def sample(logits: jax.Array, md: SamplingMetadata, *, num_top_logprobs: int = 0,
           all_greedy: bool = False) -> SamplerOutput:
    """Draw one token per row of `logits` f32[S, V].

    Order: penalties -> min_tokens mask -> temperature -> top-k -> top-p -> min-p -> draw.
    Greedy rows (temperature < SAMPLING_EPS) take the exact argmax of the penalised, masked logits.
    Other rows draw from the filtered distribution by inverse CDF with uniforms from
    fold_in(key(seed), step): the same seed gives the same tokens whatever else is in the batch.
    Returned logprobs are those of the logits given, before penalties and temperature (the raw
    log_softmax), as vLLM reports by default. A constrained row's logits come through
    `apply_token_bitmask` first, so its logprobs are of the distribution renormalised over the
    tokens its grammar allows (the others are -inf), as in vLLM, whose bitmask also precedes
    its sampler.

    No sort: top-k and top-p thresholds are found by bisection over the logit values (a full sort
    of a vocabulary-wide row is slow on a CPU; measured: benchmarks/RESULTS.md, "The sampler's
    top-k and top-p on the CPU"), and both run only when some row asks for them; on XLA:CPU a
    kernel finds them instead (`_top_k_top_p`).
    The penalty path is compiled in only when md.history_token_ids is wider than 0.
    `all_greedy` (static; the caller checks md.temperature on the host) compiles the draw out.
    """
    raw = logits.astype(jnp.float32)
    # log_softmax only where read: logit - logsumexp, without an [S, V] log_softmax array.
    lse = jax.nn.logsumexp(raw, axis=-1)
    logits = raw
    if md.history_token_ids.shape[1] > 0:
        logits = _apply_penalties(logits, md)
    rows = jnp.arange(logits.shape[0])[:, None]
    blocked = _scatter_ids(md.blocked_token_ids, logits.shape[1])
    logits = logits.at[rows, blocked].set(-jnp.inf, mode="drop")
    # A mixed step runs both paths for every row: on XLA:CPU a lax.cond skipping the draw saved
    # nothing (its operand buffers cost as much as the draw). An all-greedy step is a separate
    # program without the draw (measured: benchmarks/RESULTS.md, the host C record of issue 18's
    # "the CPU step", commit 0b3195c).
    token_ids = _argmax(logits)
    if not all_greedy:
        token_ids = jnp.where(md.temperature < SAMPLING_EPS, token_ids, _draw(logits, md))
    logprobs = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - lse
    if num_top_logprobs > 0:
        top_logits, top_ids = lax.top_k(raw, num_top_logprobs)
        top_logprobs = top_logits - lse[:, None]
    else:
        top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
    return SamplerOutput(token_ids, logprobs, top_ids.astype(jnp.int32), top_logprobs)


def _argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of each row's largest value) of f32[S, V],
    i32[S], taken blockwise: the block with the largest maximum, then the index in that block.
    XLA:CPU runs argmax's (value, index) reduction element by element but a max vectorised, so
    this is many times faster. Blocks divide V where a width of 64-1024 does, as padding the row
    costs more than the whole blockwise argmax; otherwise the row is padded with -inf.
    Measured: benchmarks/RESULTS.md, "Decodes through a C++ kernel". With NaN logits the token is
    unspecified, as no token is the most likely."""
    S, V = logits.shape
    block = max((b for b in range(64, 1025) if V % b == 0), default=_BLOCK)
    nb = cdiv(V, block)
    if nb * block != V:
        logits = jnp.pad(logits, ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf)
    blocks = logits.reshape(S, nb, block)
    b = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    in_block = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    return (b * block + jnp.argmax(in_block, axis=-1)).astype(jnp.int32)


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per row of a token bitmask over the vocabulary (the layout llguidance fills:
    token t is allowed when bit t % 32 of word t // 32 is set)."""
    return cdiv(vocab_size, 32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [S, V] with every token whose bit is clear in bitmask i32[S, bitmask_width(V)] set to
    -inf: the structured-output step, run before `sample` on steps with a constrained row. An
    all-ones row (an unconstrained one) keeps its logits."""
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)[None, None, :]
    bits = lax.shift_right_logical(bitmask[:, :, None], shifts) & 1
    allowed = bits.reshape(S, -1)[:, :V] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _scatter_ids(ids: jax.Array, vocab_size: int) -> jax.Array:
    """Row ids as scatter indices: -1 padding becomes vocab_size, which mode="drop" skips."""
    return jnp.where(ids >= 0, ids, vocab_size)


def _apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Repetition (HF/vLLM: over prompt + output, divide positive logits, multiply negative ones),
    then presence and frequency (OpenAI: over output tokens only).

    Gathers and scatters at the history's S x H ids instead of building [S, V] count arrays. Where
    an id repeats, every copy writes the same value, so the order of duplicate writes is moot."""
    S, V = logits.shape
    hist = md.history_token_ids
    rows = jnp.arange(S)[:, None]
    seen = _scatter_ids(hist, V)
    is_output = jnp.arange(hist.shape[1])[None, :] >= md.num_prompt_tokens[:, None]
    out = jnp.where(is_output, seen, V)
    rp = md.repetition_penalty[:, None]
    g = _gather(logits, seen)
    logits = logits.at[rows, seen].set(jnp.where(g > 0, g / rp, g * rp), mode="drop")
    presence = _gather(logits, out) - md.presence_penalty[:, None]
    logits = logits.at[rows, out].set(presence, mode="drop")
    frequency = jnp.broadcast_to(md.frequency_penalty[:, None], hist.shape)
    return logits.at[rows, out].add(-frequency, mode="drop")  # once per occurrence


def _gather(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """logits[row, id] for scatter ids (out-of-range ids read a value the scatter then drops)."""
    return jnp.take_along_axis(logits, jnp.minimum(ids, logits.shape[1] - 1), axis=1)


def _draw(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    scaled = _top_k_top_p(logits / jnp.maximum(md.temperature, SAMPLING_EPS)[:, None], md)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    # min_p keeps p_i >= min_p * p_max, i.e. logit_i >= logit_max + log(min_p); log(0) = -inf.
    scaled = jnp.where(scaled >= top + jnp.log(md.min_p)[:, None], scaled, -jnp.inf)
    weights = jnp.exp(scaled - top)
    uniforms = jax.vmap(_row_uniforms)(md.seeds, md.steps)
    return _inverse_cdf(weights, uniforms)


def _top_k_top_p(scaled: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The scaled logits with what top-k, then top-p, drop set to -inf. Where the CPU kernels
    are enabled (jaxserve.kernels.cpu: on XLA:CPU, built, not switched off), a kernel that buckets
    each row's values finds its thresholds (jaxserve.kernels.sampling; exact); elsewhere bisection
    does (`_top_k`, `_top_p`), whose 32 passes over [rows, vocabulary] cost little on an
    accelerator's bandwidth."""
    if cpu_kernels.enabled():
        t = cpu_sampling.thresholds(scaled, md.top_k, md.top_p)
        return jnp.where(scaled >= t[:, None], scaled, -jnp.inf)
    scaled = lax.cond(jnp.any(md.top_k > 0), _top_k, lambda s, _: s, scaled, md.top_k)
    return lax.cond(jnp.any(md.top_p < 1), _top_p, lambda s, _: s, scaled, md.top_p)


def _row_uniforms(seed: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.random.uniform(jax.random.fold_in(key, step), (2,), jnp.float32)


def _bisect(lo: jax.Array, hi: jax.Array, ok) -> jax.Array:
    """Largest t in [lo, hi) with ok(t), per row, given ok(lo) and not ok(hi) (ok monotone)."""
    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    return lax.fori_loop(0, _BISECT_STEPS, body, (lo, hi))[0]


def _bounds(scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    finite = jnp.isfinite(scaled)
    hi = jnp.max(scaled, axis=-1)
    lo = jnp.min(jnp.where(finite, scaled, hi[:, None]), axis=-1)
    # Strictly above the max, so ok(hi) is false for any threshold that keeps a token.
    return lo, hi + jnp.maximum(jnp.abs(hi), 1.0) * 1e-6


def _top_k(scaled: jax.Array, top_k: jax.Array) -> jax.Array:
    """Keep each row's top_k largest logits (ties at the k-th value kept too)."""
    num_finite = jnp.sum(jnp.isfinite(scaled), axis=-1)
    k = jnp.minimum(top_k, num_finite)
    lo, hi = _bounds(scaled)
    t = _bisect(lo, hi, lambda t: jnp.sum(scaled >= t[:, None], axis=-1) >= k)
    keep = (scaled >= t[:, None]) | (top_k <= 0)[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def _top_p(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(scaled - top)
    target = top_p * jnp.sum(weights, axis=-1)
    lo, hi = _bounds(scaled)
    t = _bisect(lo, hi, lambda t: jnp.sum(jnp.where(scaled >= t[:, None], weights, 0), axis=-1)
                >= target)
    keep = (scaled >= t[:, None]) | (top_p >= 1)[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def _inverse_cdf(weights: jax.Array, uniforms: jax.Array) -> jax.Array:
    """Token ids drawn with probability proportional to weights f32[S, V] (>= 0, some > 0)."""
    S, V = weights.shape
    nb = cdiv(V, _BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, nb * _BLOCK - V))).reshape(S, nb, _BLOCK)
    b = _pick(jnp.sum(blocks, axis=-1), uniforms[:, 0])
    in_block = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    return (b * _BLOCK + _pick(in_block, uniforms[:, 1])).astype(jnp.int32)


def _pick(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the index i with cumsum[i-1] <= u * total < cumsum[i]: each index with probability
    weight / total. Rounding can put u * total at the very end: then the last positive weight."""
    cum = jnp.cumsum(weights, axis=-1)
    i = jnp.sum(cum <= (u * cum[:, -1])[:, None], axis=-1)
    n = weights.shape[1]
    last_positive = n - 1 - jnp.argmax(jnp.flip(weights > 0, axis=-1), axis=-1)
    return jnp.where(i < n, i, last_positive)

"""The step shapes derived from the configs (jaxserve.executor.batch_plan.StepShapes): token buckets
from min_token_bucket, the sequence and logits rows of each, and the room speculation may fill."""

from __future__ import annotations

import pytest

from jaxserve.executor.batch_plan import StepShapes, token_buckets
from jaxserve.config import SchedulerConfig
from jaxserve.errors import ConfigError


def shapes(num_speculative_tokens: int = 0, **scheduler) -> StepShapes:
    return StepShapes.of(SchedulerConfig(**scheduler), page_size=16, num_pages=64,
                         num_speculative_tokens=num_speculative_tokens)


def test_token_buckets_are_powers_of_two_from_the_smallest_to_cover_the_budget():
    assert token_buckets(512, 1) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert token_buckets(48, 16) == [16, 32, 64]  # the budget rounds up to a power of two
    assert token_buckets(8, 16) == [8]  # a budget below the smallest bucket is its own bucket
    assert shapes().token_buckets == tuple(token_buckets(256, 1))  # the default: from 1
    assert shapes(min_token_bucket=16).token_buckets == (16, 32, 64, 128, 256)
    assert shapes(min_token_bucket=4, max_num_batched_tokens=32).token_bucket(3) == 4


@pytest.mark.parametrize("bad", [0, -4, 3, 12])
def test_min_token_bucket_must_be_a_power_of_two(bad):
    with pytest.raises(ConfigError, match="min_token_bucket"):
        SchedulerConfig(min_token_bucket=bad)


def test_small_buckets_have_as_many_sequences_and_rows_as_tokens():
    s = shapes(max_num_seqs=32, max_num_batched_tokens=64)
    assert [(t, s.seq_bucket(t), s.logits_bucket(t)) for t in s.token_buckets] == [
        (1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8), (16, 16, 16), (32, 32, 32), (64, 32, 32)]
    assert s.row_buckets == (1, 2, 4, 8, 16, 32)
    # Speculation: a 1-sequence engine still has rows for one decode verifying its drafts.
    s = shapes(num_speculative_tokens=4, max_num_seqs=1, max_num_batched_tokens=32)
    assert [(t, s.seq_bucket(t), s.logits_bucket(t)) for t in s.token_buckets] == [
        (1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 8), (16, 1, 8), (32, 1, 8)]


def test_drafts_may_grow_a_small_step_to_16_tokens_and_a_larger_one_to_its_own_bucket():
    s = shapes(max_num_batched_tokens=256)
    assert [s.draft_bucket(n) for n in (1, 5, 16, 17, 100)] == [16, 16, 16, 32, 128]
    # Never past the largest bucket.
    assert shapes(max_num_seqs=4, max_num_batched_tokens=8).draft_bucket(1) == 8
    # With 16-token buckets (the behaviour before small buckets) a draft never changes the bucket.
    s = shapes(min_token_bucket=16, max_num_batched_tokens=64)
    assert all(s.draft_bucket(n) == s.token_bucket(n) for n in range(1, 65))

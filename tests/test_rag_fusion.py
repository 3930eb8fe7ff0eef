"""Reciprocal-rank fusion on hand-checkable rankings."""

from __future__ import annotations

import pytest

from jaxserve.rag.fusion import reciprocal_rank_fusion


def test_rrf_by_hand():
    dense = ["a", "b", "c"]
    bm25 = ["c", "d", "a"]
    # k = 1 keeps the arithmetic simple: score = sum of 1 / (1 + rank).
    # a: 1/2 + 1/4 = 0.75   c: 1/4 + 1/2 = 0.75   b: 1/3   d: 1/3
    fused = reciprocal_rank_fusion([dense, bm25], k=1)
    assert [item for item, _ in fused] == ["a", "c", "b", "d"]
    assert [score for _, score in fused] == pytest.approx([0.75, 0.75, 1 / 3, 1 / 3])


def test_agreement_beats_a_single_first_place():
    # "x" is first in one list only; "y" is second in both: 2/62 > 1/61 + nothing.
    fused = reciprocal_rank_fusion([["x", "y"], ["z", "y"]], k=60)
    assert fused[0] == ("y", pytest.approx(2 / 62))
    assert [item for item, _ in fused][1:] == ["x", "z"]


def test_empty_rankings():
    assert reciprocal_rank_fusion([[], []]) == []
    assert reciprocal_rank_fusion([["a"], []]) == [("a", pytest.approx(1 / 61))]

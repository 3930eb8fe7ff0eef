"""Reciprocal-rank fusion on hand-checkable rankings."""

from __future__ import annotations

import pytest

from jaxserve.rag.fusion import interleave, rank_documents, reciprocal_rank_fusion


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


def test_weighted_rrf():
    # Weight 3 on the second ranking: d = 3/2, b = 1/3 + 3/3, a = 1/2.
    fused = reciprocal_rank_fusion([["a", "b"], ["d", "b"]], k=1, weights=[1.0, 3.0])
    assert [item for item, _ in fused] == ["d", "b", "a"]
    assert [score for _, score in fused] == pytest.approx([1.5, 4 / 3, 0.5])


def test_rank_documents_groups_chunks_and_penalises_length():
    document_of = {1: "long", 2: "long", 3: "short", 4: "long", 5: "gone?"}
    chunks = [(1, 0.90), (3, 0.88), (2, 0.80), (4, 0.70), (99, 0.99)]  # 99: deleted meanwhile
    assert rank_documents(chunks, document_of) == [("long", 0.90), ("short", 0.88)]
    assert rank_documents(chunks, document_of, top_chunks=2) == [
        ("long", pytest.approx(1.70)), ("short", pytest.approx(0.88))]
    # 0.90 - 0.02 ln 40 = 0.826 < 0.88 - 0.02 ln 2 = 0.866: the short document wins.
    ranked = rank_documents(chunks, document_of, length_penalty=0.02,
                            num_chunks={"long": 40, "short": 2})
    assert [d for d, _ in ranked] == ["short", "long"]


def test_interleave_covers_documents_first_then_fills():
    document_of = {1: "a", 2: "a", 3: "b", 4: "a", 5: "c"}
    documents = [("a", 0.9), ("b", 0.5)]  # "c" is not among the ranked documents
    order = [2, 1, 3, 4, 5]
    assert interleave(documents, order, document_of, 2) == [(2, 0.9), (3, 0.5)]
    assert interleave(documents, order, document_of, 10) == [(2, 0.9), (3, 0.5), (1, 0.9),
                                                              (4, 0.9)]
    assert interleave([], order, document_of, 3) == []

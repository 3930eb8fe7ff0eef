"""Reciprocal-rank fusion (Cormack, Clarke and Buettcher, SIGIR 2009).

RRF adds 1 / (k + rank) over the rankings an item appears in. It needs no score calibration, which
matters here: cosine similarities and BM25 scores live on unrelated scales.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hashable]],
                           k: int = 60) -> list[tuple[Hashable, float]]:
    """(item, fused score) best first; ranks start at 1; ties keep first-seen order."""
    scores: dict[Hashable, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])

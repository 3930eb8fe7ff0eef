"""Rankings -> one ranking: document-level aggregation of chunk scores, weighted reciprocal-rank
fusion (Cormack, Clarke and Buettcher, SIGIR 2009), and the interleaving that turns a document
ranking back into chunk results.

Why documents before fusion (measured, benchmarks/RESULTS.md): with chunk-level fusion, 2 of every
5 result slots went to a document already listed, and where hybrid missed a query that one
retriever alone got right, the document it put first was a long one (pydoc: median 82 chunks,
against 3 for the right one): a long document that touches everything has a chunk moderately
high in both lists, which RRF rewards over one retriever's first place. Ranking documents, with
a penalty for their length and a ranking of their openings, counters both.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hashable]], k: int = 60,
                           weights: Sequence[float] | None = None
                           ) -> list[tuple[Hashable, float]]:
    """(item, fused score) best first: the sum over rankings of weight / (k + rank); ranks start
    at 1; ties keep first-seen order. RRF needs no score calibration, which matters here: cosine
    similarities and BM25 scores live on unrelated scales."""
    weights = [1.0] * len(rankings) if weights is None else weights
    scores: dict[Hashable, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def rank_documents(chunks: Sequence[tuple[int, float]], document_of: Mapping[int, str],
                   top_chunks: int = 1, length_penalty: float = 0.0,
                   num_chunks: Mapping[str, int] | None = None) -> list[tuple[str, float]]:
    """A document ranking from a chunk ranking (chunk id, score), best first: a document scores
    the sum of its `top_chunks` best chunks' scores (1: its best chunk), less
    `length_penalty * ln(its number of chunks)`. Why the penalty: the best of n chunk scores
    grows with n even for an unrelated document (the maximum of n noisy draws), so long
    documents that mention everything otherwise outrank the short one about the query. Chunks
    missing from `document_of` (deleted meanwhile) are skipped."""
    taken: dict[str, list[float]] = {}
    for chunk_id, score in chunks:
        document = document_of.get(chunk_id)
        if document is not None and len(taken.setdefault(document, [])) < top_chunks:
            taken[document].append(score)
    counts = num_chunks or {}
    return sorted(((d, sum(s) - length_penalty * math.log(counts.get(d, 1)))
                   for d, s in taken.items()), key=lambda kv: -kv[1])


def interleave(documents: Sequence[tuple[str, float]], chunk_order: Sequence[int],
               document_of: Mapping[int, str], top_k: int) -> list[tuple[int, float]]:
    """Up to top_k (chunk id, document score): first each document's best chunk in document
    order, then second-best chunks in the same order, and so on — a result list covers as many
    documents as it can, yet a collection of one long document still fills top_k."""
    per_document: dict[str, list[int]] = {d: [] for d, _ in documents}
    for chunk_id in chunk_order:
        document = document_of.get(chunk_id)
        if document in per_document:
            per_document[document].append(chunk_id)
    out: list[tuple[int, float]] = []
    depth = 0
    while len(out) < top_k:
        row = [(chunks[depth], score) for d, score in documents
               if len(chunks := per_document[d]) > depth]
        if not row:
            return out
        out += row[:top_k - len(out)]
        depth += 1
    return out

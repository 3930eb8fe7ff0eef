"""Retrieval quality of a collection on labelled queries: recall@k and top-1 accuracy per mode.

A query counts as recalled at k when any of its top-k chunks belongs to one of its relevant
documents (chunks of one document are not deduplicated: a document covering several of the top k
slots leaves fewer slots for others, as a reader of the results would see).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.rag.config import SEARCH_MODES
from jaxserve.rag.service import RagService


@dataclass(frozen=True)
class LabelledQuery:
    query: str
    relevant: frozenset[str]  # document ids that answer it


@dataclass(frozen=True)
class Quality:
    mode: str
    recall_at_k: float
    top1: float
    k: int


def evaluate(service: RagService, collection: str, queries: list[LabelledQuery], k: int = 5,
             modes: tuple[str, ...] = SEARCH_MODES) -> list[Quality]:
    out = []
    for mode in modes:
        hits = top1 = 0
        for q in queries:
            docs = [r.document_id for r in service.search(collection, q.query, k, mode)]
            hits += any(d in q.relevant for d in docs)
            top1 += bool(docs) and docs[0] in q.relevant
        out.append(Quality(mode, hits / len(queries), top1 / len(queries), k))
    return out

"""Retrieval quality on text no one here wrote: Python's pydoc_data.topics, one document per
topic, against the labelled queries in benchmarks/data/pydoc_queries.json.

To keep the suite fast each topic is cut to its opening 1,200 characters (where the topic says
what it is); `benchmarks/retrieval.py` reports the same measure on the full topics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pydoc_data.topics
import pytest

from jaxserve.rag.config import RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.evaluation import LabelledQuery, evaluate
from jaxserve.rag.service import RagService
from tests.rag_helpers import minilm_embedder

pytestmark = pytest.mark.slow
QUERIES = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "pydoc_queries.json"
TOPIC_CHARS = 1200


def load_queries() -> list[LabelledQuery]:
    items = json.loads(QUERIES.read_text())["queries"]
    return [LabelledQuery(q["query"], frozenset(q["relevant"])) for q in items]


def test_queries_name_real_topics():
    queries = load_queries()
    assert len(queries) >= 30
    for q in queries:
        assert q.relevant <= set(pydoc_data.topics.topics), q


def test_recall_at_5_and_top1_per_mode(tmp_path):
    service = RagService(RagConfig(tmp_path), minilm_embedder())
    service.create_collection("pydoc")
    service.upsert("pydoc", [Document(topic, text[:TOPIC_CHARS])
                             for topic, text in pydoc_data.topics.topics.items()])
    quality = {q.mode: q for q in evaluate(service, "pydoc", load_queries(), k=5)}
    for q in quality.values():
        print(f"pydoc topics (first {TOPIC_CHARS} chars), {q.mode}: recall@5 {q.recall_at_k:.3f}, "
              f"top-1 {q.top1:.3f}")
    # Floors well under what the pipeline measures (0.88-0.94 recall@5, 0.78 top-1 for each
    # mode) and far above chance (5 of 79 topics); a broken encoder, index or fusion falls below.
    for q in quality.values():
        assert q.recall_at_k >= 0.75 and q.top1 >= 0.6, q
    assert quality["hybrid"].recall_at_k >= min(quality["dense"].recall_at_k,
                                                quality["bm25"].recall_at_k)
    service.close()

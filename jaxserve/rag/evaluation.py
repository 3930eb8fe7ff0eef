"""Retrieval quality on labelled queries (recall@k, top-1 accuracy), and the two labelled corpora
it is measured on: Python's pydoc topics and NumPy's docstrings (benchmarks/data/*.json).

A query counts as recalled at k when any of its top-k results belongs to one of its relevant
documents, and as a top-1 hit when the first does (results are counted as a reader of them sees
them: two chunks of one document take two of the k places).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxserve.rag.documents import Document

_NUMPY_MIN_DOC_CHARS = 400


@dataclass(frozen=True)
class LabelledQuery:
    query: str
    relevant: frozenset[str]  # document ids that answer it


@dataclass(frozen=True)
class Quality:
    recall_at_k: float
    top1: float
    k: int


def load_queries(path: Path) -> list[LabelledQuery]:
    """A labelled set: {"about": how it was made, "queries": [{"query", "relevant": [ids]}]}."""
    items = json.loads(Path(path).read_text())["queries"]
    return [LabelledQuery(q["query"], frozenset(q["relevant"])) for q in items]


def pydoc_topics() -> list[Document]:
    """Python's pydoc_data.topics, one document per topic (the language reference's sections)."""
    import pydoc_data.topics

    return [Document(topic, text) for topic, text in sorted(pydoc_data.topics.topics.items())]


def numpy_docstrings() -> list[Document]:
    """NumPy's public functions (numpy, numpy.linalg, numpy.fft; no classes), one document per
    docstring of at least 400 characters; aliases (same docstring) keep their first name."""
    import numpy

    seen: dict[str, str] = {}
    for module in (numpy, numpy.linalg, numpy.fft):
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or inspect.isclass(obj) or inspect.ismodule(obj) \
                    or not callable(obj):
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) >= _NUMPY_MIN_DOC_CHARS and doc not in seen:
                seen[doc] = f"{module.__name__}.{name}"
    return [Document(name, doc) for doc, name in seen.items()]


CORPORA: dict[str, Callable[[], list[Document]]] = {"pydoc": pydoc_topics,
                                                    "numpy": numpy_docstrings}


def evaluate(search: Callable[[str, int], Sequence[str]], queries: list[LabelledQuery],
             k: int = 5) -> Quality:
    """`search(query, k)` -> the document id of each of its top-k results, best first."""
    hits = top1 = 0
    for q in queries:
        documents = list(search(q.query, k))[:k]
        hits += any(d in q.relevant for d in documents)
        top1 += bool(documents) and documents[0] in q.relevant
    return Quality(hits / len(queries), top1 / len(queries), k)

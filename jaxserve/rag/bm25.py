"""Lexical retrieval: BM25 (Okapi, bm25s' defaults k1=1.5, b=0.75) over chunk texts.

bm25s (maintained, sparse-matrix scoring, numpy + scipy only) does the scoring. Its index cannot be
updated in place, so a collection rebuilds this from the store's chunk texts on the first lexical
search after a change; it is derived data and not saved.
"""

from __future__ import annotations

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer


class BM25Index:
    def __init__(self, ids: list[int], texts: list[str]):
        self._ids = np.asarray(ids, np.int64)
        self._tokenizer = Tokenizer(stopwords="en", lower=True)
        self._retriever = None
        if ids:
            tokens = self._tokenizer.tokenize(texts, return_as="tuple", show_progress=False)
            self._retriever = bm25s.BM25()
            self._retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Up to k (chunk id, score) pairs, best first; only chunks sharing a term with the
        query."""
        if self._retriever is None:
            return []
        query_ids = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids",
                                             show_progress=False)
        k = min(k, len(self._ids))
        rows, scores = self._retriever.retrieve(query_ids, k=k, show_progress=False, n_threads=1)
        return [(int(self._ids[r]), float(s)) for r, s in zip(rows[0], scores[0]) if s > 0]

"""Reranking: late interaction (ColBERT's MaxSim) over the embedding model's token vectors.

A query and a passage are encoded separately, token by token; each query token takes its best
match among the passage's tokens and the passage scores the mean of those matches. Unlike the
one pooled vector per chunk, this sees which query words a passage answers. It needs no other
weights (no cross-encoder ships in a PyPI package we found) and no engine: the encoder runs the
candidates in one bucketed batch. Why this one, against the alternatives, is measured in
benchmarks/RESULTS.md ("Reranking").
"""

from __future__ import annotations

import numpy as np

from jaxserve.rag.embedder import Embedder


class LateInteractionReranker:
    def __init__(self, embedder: Embedder):
        self.embedder = embedder

    @property
    def name(self) -> str:
        return self.embedder.name

    def score(self, query: str, passages: list[str]) -> tuple[np.ndarray, int]:
        """(relevance score per passage [len(passages)], tokens the encoder read). Scores are mean
        cosine similarities in [-1, 1]; passages past the encoder's max_length are truncated."""
        ids = self.embedder.tokenize([query, *passages])
        vectors = self.embedder.token_vectors(ids)
        # [CLS] and [SEP] carry no word of their own: compare the text's tokens only.
        query_tokens = vectors[0][1:-1] if len(vectors[0]) > 2 else vectors[0]
        scores = np.array([float((query_tokens @ v[1:-1].T).max(axis=1).mean())
                           if len(v) > 2 else -1.0 for v in vectors[1:]], np.float32)
        return scores, sum(len(i) for i in ids)

"""Lexical retrieval: Okapi BM25 over chunk texts, updated in place as chunks come and go.

Scoring is Lucene's BM25 (bm25s' default "lucene" method, k1=1.5, b=0.75):
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)),
    score(q, c) = sum over q's terms t of idf(t) * tf / (tf + k1 * (1 - b + b * len(c) / avglen)),
with N, df and avglen those of the live chunks at the time of the query, so an index kept up to
date chunk by chunk ranks exactly as one rebuilt from scratch (tests/test_rag_bm25.py checks it).
bm25s (tokenizer, stopwords) splits texts; its index cannot be updated, hence this one.
Terms are stemmed (Snowball's English stemmer, PyStemmer), as Lucene's English analyzer does:
queries paraphrase, and without it "declare" never meets "declaration" — measured in
benchmarks/RESULTS.md (pydoc recall@5 0.938 -> 0.969 in hybrid).

Layout, after Lucene's segments: each add() becomes a segment, a sparse chunk x term matrix of
term frequencies (scipy CSC, so a query reads only its terms' columns); remove() marks rows dead
and takes them out of N, df and the length sum at once; when segments pile up they are merged
into one, dropping dead rows. Nothing is re-tokenised after the chunk's first add.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import bm25s
import numpy as np
import scipy.sparse as sp
import Stemmer

K1, B = 1.5, 0.75
_MAX_SEGMENTS = 8




@dataclass
class _Segment:
    ids: np.ndarray  # int64 [n] chunk ids
    lengths: np.ndarray  # float64 [n] terms per chunk
    tf: sp.csc_matrix  # [n, vocabulary size when built] term frequencies
    live: np.ndarray  # bool [n]
    # Each row's term columns (CSR indptr / indices): what remove() takes out of df, without
    # scanning the column-major matrix.
    row_start: np.ndarray
    row_terms: np.ndarray

    @classmethod
    def build(cls, ids: np.ndarray, lengths: np.ndarray, tf: sp.spmatrix) -> "_Segment":
        rows = tf.tocsr()
        return cls(ids, lengths, tf.tocsc(), np.ones(len(ids), bool), rows.indptr, rows.indices)


class BM25Index:
    """stemmer: a Snowball language name (Stemmer.algorithms()), or None for whole words. Not
    thread-safe (nor is the stemmer it owns): the collection calls it under its lock."""

    def __init__(self, ids: list[int] | None = None, texts: list[str] | None = None,
                 stemmer: str | None = "english"):
        self._stemmer = Stemmer.Stemmer(stemmer) if stemmer else None
        self._vocab: dict[str, int] = {}
        self._df = np.zeros(0, np.int64)
        self._segments: list[_Segment] = []
        self._where: dict[int, tuple[int, int]] = {}  # chunk id -> (segment, row)
        self._total_length = 0.0
        if ids:
            self.add(ids, texts)

    def __len__(self) -> int:
        return len(self._where)

    def _terms(self, texts: list[str]) -> list[list[str]]:
        return bm25s.tokenize(texts, lower=True, stopwords="en", stemmer=self._stemmer,
                              return_ids=False, show_progress=False)

    def add(self, ids: list[int], texts: list[str]) -> None:
        """Index new chunks (ids not already present)."""
        if not len(ids):
            return
        rows, cols, counts = [], [], []
        for r, terms in enumerate(self._terms(list(texts))):
            for term, n in Counter(terms).items():
                rows.append(r)
                cols.append(self._vocab.setdefault(term, len(self._vocab)))
                counts.append(n)
        vocab = len(self._vocab)
        self._df = np.concatenate([self._df, np.zeros(vocab - len(self._df), np.int64)])
        np.add.at(self._df, np.asarray(cols, np.int64), 1)
        tf = sp.csc_matrix((np.asarray(counts, np.float64), (rows, cols)),
                           shape=(len(ids), vocab))
        lengths = np.asarray(tf.sum(axis=1), np.float64).ravel()
        self._total_length += float(lengths.sum())
        segment = len(self._segments)
        self._segments.append(_Segment.build(np.asarray(ids, np.int64), lengths, tf))
        self._where.update((int(i), (segment, r)) for r, i in enumerate(ids))
        if len(self._segments) > _MAX_SEGMENTS:
            self._merge()

    def remove(self, ids) -> None:
        """Forget these chunks (unknown ids are ignored)."""
        for chunk_id in ids:
            where = self._where.pop(int(chunk_id), None)
            if where is None:
                continue
            seg = self._segments[where[0]]
            seg.live[where[1]] = False
            self._total_length -= seg.lengths[where[1]]
            row = where[1]
            self._df[seg.row_terms[seg.row_start[row]:seg.row_start[row + 1]]] -= 1

    def _merge(self) -> None:
        vocab = len(self._vocab)
        parts = []
        for seg in self._segments:
            tf = seg.tf.copy()
            tf.resize((tf.shape[0], vocab))
            parts.append(tf[seg.live])
        ids = np.concatenate([s.ids[s.live] for s in self._segments])
        lengths = np.concatenate([s.lengths[s.live] for s in self._segments])
        self._segments = [_Segment.build(ids, lengths, sp.vstack(parts, format="csc"))]
        self._where = {int(i): (0, r) for r, i in enumerate(ids)}

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Up to k (chunk id, score) pairs, best first (ties by id); only chunks sharing a term
        with the query."""
        n = len(self._where)
        columns = list(dict.fromkeys(self._vocab[t] for t in self._terms([query])[0]
                                     if t in self._vocab))
        if not n or not columns:
            return []
        df = self._df[columns].astype(np.float64)
        idf = np.log1p((n - df + 0.5) / (df + 0.5))
        average_length = self._total_length / n
        found_ids, found_scores = [], []
        for seg in self._segments:
            here = [j for j, c in enumerate(columns) if c < seg.tf.shape[1]]
            # COO of a CSC column slice lists entries column by column, i.e. in query-term
            # order: each chunk's terms are summed in the same order however it was indexed.
            block = seg.tf[:, [columns[j] for j in here]].tocoo()
            live = seg.live[block.row]
            rows, tf = block.row[live], block.data[live]
            if not len(rows):
                continue
            norm = K1 * (1 - B + B * seg.lengths[rows] / average_length)
            contribution = idf[np.asarray(here)[block.col[live]]] * tf / (tf + norm)
            unique, inverse = np.unique(rows, return_inverse=True)
            found_ids.append(seg.ids[unique])
            found_scores.append(np.bincount(inverse, weights=contribution))
        if not found_ids:
            return []
        ids, scores = np.concatenate(found_ids), np.concatenate(found_scores)
        order = np.lexsort((ids, -scores))[:k]
        return [(int(ids[i]), float(scores[i])) for i in order]

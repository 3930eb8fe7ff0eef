"""BM25 kept up to date in place ranks exactly as one rebuilt from the same live chunks."""

from __future__ import annotations

import bm25s
import numpy as np
import Stemmer
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.rag.bm25 import BM25Index

WORDS = ["cat", "dog", "fish", "bird", "tree", "rock", "river", "stone", "cloud", "rain"]
texts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=12).map(" ".join)
# A history of operations: ("add", texts) appends chunks with fresh ids; ("remove", picks)
# removes the live chunks at those positions (mod the number of live chunks).
operations = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(texts, min_size=1, max_size=6)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 1000), min_size=1, max_size=4))),
    min_size=1, max_size=14)
queries = st.lists(st.sampled_from(WORDS + ["unknown"]), min_size=1, max_size=4).map(" ".join)


@settings(max_examples=60, deadline=None)
@given(operations, queries)
def test_incremental_equals_full_rebuild(history, query):
    index, live, next_id = BM25Index(), {}, 0
    for op, arg in history:
        if op == "add":
            ids = list(range(next_id, next_id + len(arg)))
            next_id += len(arg)
            index.add(ids, arg)
            live.update(zip(ids, arg))
        elif live:
            gone = {sorted(live)[p % len(live)] for p in arg}
            index.remove(gone)
            for chunk_id in gone:
                del live[chunk_id]
    rebuilt = BM25Index(list(live), list(live.values()))
    assert len(index) == len(rebuilt) == len(live)
    assert index.search(query, 50) == rebuilt.search(query, 50)


def test_scores_match_bm25s():
    corpus = ["the cat sat on the mat", "a dog chased the cat", "fish swim in the river",
              "the river flows past the stone", "birds sing in the tree"]
    ours = BM25Index(list(range(10, 15)), corpus)
    stemmer = Stemmer.Stemmer("english")
    reference = bm25s.BM25()
    reference.index(bm25s.tokenize(corpus, stopwords="en", stemmer=stemmer,
                                   show_progress=False), show_progress=False)
    for query in ("cat", "river stone", "tree birds dog", "flowing rivers"):
        rows, scores = reference.retrieve(bm25s.tokenize([query], stopwords="en",
                                                         stemmer=stemmer, show_progress=False),
                                          k=len(corpus), show_progress=False)
        expected = {10 + int(r): float(s) for r, s in zip(rows[0], scores[0]) if s > 0}
        found = dict(ours.search(query, len(corpus)))
        assert found.keys() == expected.keys()
        np.testing.assert_allclose([found[i] for i in expected], list(expected.values()),
                                   rtol=1e-5)


def test_stemming_matches_word_forms():
    corpus = ["the global statement is a declaration", "declare nothing here: a cat"]
    assert {i for i, _ in BM25Index([0, 1], corpus).search("declaring declarations", 5)} == {0, 1}
    assert BM25Index([0, 1], corpus, stemmer=None).search("declaring declarations", 5) == []


def test_merging_segments_keeps_rankings():
    index = BM25Index()
    for i in range(20):  # more adds than segments kept: merged along the way
        index.add([i], [f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]}"])
        if i % 4 == 3:
            index.remove([i - 1])
    assert len(index._segments) <= 8
    live = {i: f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]}" for i in range(20) if i % 4 != 2}
    assert index.search("cat rock", 20) == BM25Index(list(live), list(live.values())).search(
        "cat rock", 20)
    assert index.search("nothing here", 5) == []

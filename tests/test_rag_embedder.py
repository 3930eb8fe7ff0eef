"""Encoder: golden embeddings from HF transformers; bucketing and padding change nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.errors import InvalidRequest
from tests.rag_helpers import minilm_embedder, tiny_embedder


@pytest.mark.slow
def test_minilm_matches_hf_golden(golden_dir):
    golden = json.loads((golden_dir / "minilm_embedding_golden.json").read_text())
    embedder = minilm_embedder()
    assert embedder.tokenize(golden["sentences"]) == golden["input_ids"]
    vectors, num_tokens = embedder.embed(golden["sentences"])
    ref = np.asarray(golden["embeddings"])
    cosine = (vectors * ref).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.999, cosine
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors @ vectors.T, golden["cosine"], atol=2e-3)
    assert num_tokens == sum(len(i) for i in golden["input_ids"])


def test_batching_and_padding_do_not_change_embeddings():
    embedder = tiny_embedder()
    texts = ["short", "a somewhat longer sentence with more tokens in it " * 3, "mid length text",
             "x " * 100] + [f"filler sentence number {i}" for i in range(9)]
    together, _ = embedder.embed(texts)  # 13 texts: four batches, mixed length buckets
    alone = np.concatenate([embedder.embed([t])[0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_long_texts_are_truncated_to_max_length():
    embedder = tiny_embedder()
    ids = embedder.tokenize(["word " * 1000])[0]
    assert len(ids) == embedder.max_length and ids[-1] == 102  # [SEP] kept by truncation
    assert embedder.embed(["word " * 1000])[0].shape == (1, 32)


def test_empty_text_is_rejected():
    with pytest.raises(InvalidRequest):
        tiny_embedder().embed(["ok", ""])


def test_after_warmup_nothing_compiles():
    embedder = tiny_embedder()
    # rows 1, 2, 4 x lengths 16, 32, 64
    assert embedder.warmup() == 9
    compiled = embedder._embed._cache_size()
    embedder.embed(["after warmup", "nothing new " * 20] + ["a"] * 5)
    assert embedder._embed._cache_size() == compiled

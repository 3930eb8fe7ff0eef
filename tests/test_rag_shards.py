"""Sharded collections: stable routing, merged shard results equal to one index, persistence."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, IndexConfig, RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.service import RagService
from jaxserve.rag.shards import ShardedIndex, shard_files, shard_of
from jaxserve.rag.vector_index import VectorIndex
from tests.rag_helpers import tiny_embedder

DIM = 16


def test_routing_is_stable_and_spreads_documents():
    # Pinned: the route of a document must not change between processes, restarts or
    # releases (Python's hash() is salted per process; BLAKE2b is not).
    ids = ["a", "doc-1", "README.md", "numpy.linalg.svd", "é"]
    assert [shard_of(d, 4) for d in ids] == [0, 2, 2, 3, 3]
    assert [shard_of(d, 7) for d in ids] == [4, 4, 0, 5, 5]
    counts = np.bincount([shard_of(f"doc-{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 900  # ~1000 each


def _random(n: int, rng) -> np.ndarray:
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_merged_shards_equal_one_exact_index():
    rng = np.random.default_rng(0)
    ids = np.arange(10, 610, dtype=np.int64)
    documents = [f"doc-{i // 3}" for i in range(len(ids))]  # three chunks per document
    vectors = _random(len(ids), rng)
    one = VectorIndex(DIM, IndexConfig())
    one.rebuild(ids, vectors)
    sharded = ShardedIndex(DIM, IndexConfig(num_shards=4))
    sharded.rebuild(ids, documents, vectors)
    assert [s.num_live for s in sharded.shards] != [len(ids), 0, 0, 0]
    queries = _random(20, rng)
    for k in (1, 10, 600, 1000):
        want_scores, want_ids = one.search(queries, k)
        got_scores, got_ids = sharded.search(queries, k)
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_scores, want_scores, rtol=1e-6)
    # Deleting one document's chunks and adding another's keeps them equal.
    gone = [(int(i), d) for i, d in zip(ids, documents) if d == "doc-7"]
    new_ids, new_vectors = np.arange(1000, 1004, dtype=np.int64), _random(4, rng)
    one.update([i for i, _ in gone], new_ids, new_vectors, None)
    sharded.update(gone, new_ids, ["new"] * 4, new_vectors, None)
    np.testing.assert_array_equal(sharded.search(queries, 50)[1], one.search(queries, 50)[1])
    sharded.close()


def _service(tmp_path, num_shards: int) -> RagService:
    config = RagConfig(tmp_path, EmbedderConfig(max_batch=4, max_length=64),
                       ChunkerConfig(chunk_tokens=24, overlap_tokens=4),
                       IndexConfig(num_shards=num_shards))
    return RagService(config, tiny_embedder())


@pytest.mark.parametrize("mode", ["dense", "hybrid"])
def test_sharded_collection_searches_persists_and_reshards(tmp_path, mode):
    docs = [Document(f"d{i}", f"document {i} talks about topic {i % 5} and item {i}")
            for i in range(24)]
    unsharded = _service(tmp_path / "one", 1)
    unsharded.create_collection("c")
    unsharded.upsert("c", docs)
    service = _service(tmp_path / "many", 3)
    service.create_collection("c")
    service.upsert("c", docs)
    service.delete_document("c", "d5")
    unsharded.delete_document("c", "d5")
    query = "topic 3 and item 13"
    expected = [r.to_dict() for r in unsharded.search("c", query, 10, mode)]
    assert [r.to_dict() for r in service.search("c", query, 10, mode)] == expected
    assert "d5" not in {r["document_id"] for r in expected}
    service.close()
    assert all(p.exists() for p in shard_files(tmp_path / "many" / "collections" / "c", 3))
    for num_shards in (3, 2):  # reopened as it was, then with another shard count (rebuilt)
        reopened = _service(tmp_path / "many", num_shards)
        assert [r.to_dict() for r in reopened.search("c", query, 10, mode)] == expected
        reopened.close()
    unsharded.close()

"""Collections: persistence across restarts, deletion, exact and HNSW indexes, search modes."""

from __future__ import annotations

import pytest

from jaxserve.errors import AlreadyExists, InvalidRequest, NotFound
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, IndexConfig, RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.service import RagService
from tests.rag_helpers import tiny_embedder

TOPICS = {
    "cats": "Cats are small carnivorous mammals kept as pets; a cat purrs and chases mice.",
    "stocks": "Stock markets fell sharply as investors sold shares amid inflation worries.",
    "jax": "JAX compiles numerical Python functions with XLA for accelerators like TPUs.",
    "paris": "Paris is the capital of France, on the Seine, famous for the Eiffel Tower.",
    "bread": "Bake bread by kneading flour, water, yeast and salt, then letting dough rise.",
}


def _service(tmp_path, exact_max_vectors: int = 50_000) -> RagService:
    config = RagConfig(tmp_path, EmbedderConfig(max_batch=4, max_length=64),
                       ChunkerConfig(chunk_tokens=24, overlap_tokens=4),
                       IndexConfig(exact_max_vectors=exact_max_vectors))
    return RagService(config, tiny_embedder())


def _fill(service: RagService, name: str = "c") -> None:
    service.create_collection(name)
    service.upsert(name, [Document(k, v, {"topic": k}) for k, v in TOPICS.items()])


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid"])
def test_restart_loses_nothing(tmp_path, mode):
    service = _service(tmp_path)
    _fill(service)
    before = [r.to_dict() for r in service.search("c", "capital of France", 3, mode)]
    info = service.collection("c").info()
    service.close()
    reopened = _service(tmp_path)
    assert reopened.list_collections() == ["c"]
    assert reopened.collection("c").info() == info
    assert [r.to_dict() for r in reopened.search("c", "capital of France", 3, mode)] == before


@pytest.mark.parametrize("exact_max_vectors", [50_000, 2])  # exact; HNSW with tombstones
def test_deleted_document_is_never_returned(tmp_path, exact_max_vectors):
    service = _service(tmp_path, exact_max_vectors)
    _fill(service)
    kind = service.collection("c").info()["index"]
    assert kind == ("exact" if exact_max_vectors > 2 else "hnsw")
    service.delete_document("c", "paris")
    for mode in ("dense", "bm25", "hybrid"):
        # top_k covers the whole collection: a stale id would have nowhere to hide.
        results = service.search("c", "Paris capital of France Eiffel", 20, mode)
        assert "paris" not in {r.document_id for r in results}
    service.close()
    reopened = _service(tmp_path, exact_max_vectors)  # the saved index still holds it (HNSW)
    results = reopened.search("c", "Paris capital of France Eiffel", 20, "dense")
    assert "paris" not in {r.document_id for r in results} and results
    # Re-adding brings it back, under new chunk row ids.
    reopened.upsert("c", [Document("paris", TOPICS["paris"])])
    assert reopened.search("c", "Eiffel Tower Seine", 1, "bm25")[0].document_id == "paris"


def test_upsert_replaces_a_document_by_id(tmp_path):
    service = _service(tmp_path)
    _fill(service)
    service.upsert("c", [Document("cats", "Dogs bark loudly at the postman every morning.")])
    assert service.collection("c").info()["documents"] == len(TOPICS)
    assert service.search("c", "purrs chases mice", 5, "bm25") == []
    top = service.search("c", "dogs bark postman", 1, "bm25")[0]
    assert (top.document_id, top.metadata) == ("cats", {})


def test_chunks_carry_offsets_and_metadata(tmp_path):
    service = _service(tmp_path)
    service.create_collection("c")
    text = " ".join(f"sentence {i} about topic {i % 7}." for i in range(40))
    chunks, _ = service.upsert("c", [Document("long", text, {"lang": "en"})])
    assert chunks > 3
    results = service.search("c", "topic", 20, "bm25")
    assert {r.chunk_id for r in results} <= {f"long#{i}" for i in range(chunks)}
    for r in results:
        assert text[r.start:r.end] == r.text and r.metadata == {"lang": "en"}


def test_growing_past_the_exact_limit_switches_to_hnsw(tmp_path):
    service = _service(tmp_path, exact_max_vectors=4)
    service.create_collection("c")
    service.upsert("c", [Document(k, v) for k, v in list(TOPICS.items())[:3]])
    assert service.collection("c").info()["index"] == "exact"
    service.upsert("c", [Document(k, v) for k, v in list(TOPICS.items())[3:]])
    assert service.collection("c").info()["index"] == "hnsw"
    found = {r.document_id for r in service.search("c", "anything at all", 5, "dense")}
    assert found == set(TOPICS)


def test_collections_are_independent(tmp_path):
    service = _service(tmp_path)
    _fill(service, "a")
    service.create_collection("b")
    service.upsert("b", [Document("only", "A lone document about sailing boats.")])
    assert {r.document_id for r in service.search("b", "cats", 5, "hybrid")} == {"only"}
    service.delete_collection("a")
    assert service.list_collections() == ["b"]
    with pytest.raises(NotFound):
        service.search("a", "cats", 5, "dense")


def test_errors(tmp_path):
    service = _service(tmp_path)
    _fill(service)
    with pytest.raises(AlreadyExists):
        service.create_collection("c")
    with pytest.raises(NotFound):
        service.delete_document("c", "missing")
    for name in ("../x", "", "a/b", ".hidden"):
        with pytest.raises(InvalidRequest):
            service.create_collection(name)
    for query, top_k, mode in (("", 5, "dense"), ("  ", 5, "dense"), ("q", 0, "dense"),
                               ("q", 101, "dense"), ("q", True, "dense"), ("q", 5, "fuzzy")):
        with pytest.raises(InvalidRequest):
            service.search("c", query, top_k, mode)


@pytest.fixture
def index_saves(monkeypatch) -> list:
    """Paths of every index file written, in order."""
    from jaxserve.rag.vector_index import VectorIndex

    saves = []
    save = VectorIndex.save
    monkeypatch.setattr(VectorIndex, "save", lambda self, path: (saves.append(path),
                                                                 save(self, path)))
    return saves


def test_index_file_is_written_in_batches_and_a_crash_loses_nothing(tmp_path, monkeypatch,
                                                                    index_saves):
    """Upserts rewrite the index file only once enough has changed; a process that dies before
    its last write leaves the store complete, and the next open adds what the file lacks
    (without rebuilding the index)."""
    from jaxserve.rag import collection as collection_module
    from jaxserve.rag.vector_index import VectorIndex

    monkeypatch.setattr(collection_module, "_MIN_UNSAVED", 3)
    service = _service(tmp_path)
    service.create_collection("c")
    for k, v in TOPICS.items():
        service.upsert("c", [Document(k, v)])
    assert service.collection("c").info()["chunks"] == len(TOPICS)  # one chunk per document
    assert len(index_saves) == 1  # after the third upsert; the last two are in the store only

    def no_rebuild(*args):
        raise AssertionError("the saved index should be caught up, not rebuilt")

    monkeypatch.setattr(VectorIndex, "rebuild", no_rebuild)
    reopened = _service(tmp_path)  # no close(): as if the process had died
    for k, v in TOPICS.items():
        assert reopened.search("c", v, 1, "dense")[0].document_id == k
    reopened.close()
    assert len(index_saves) == 2  # close writes what changed


def test_hnsw_tombstones_do_not_rewrite_the_index_at_every_close(tmp_path, index_saves):
    """A saved HNSW file keeps deleted points (the graph cannot drop them); they are tombstoned
    again at each open, which is not a change worth writing."""
    service = _service(tmp_path, exact_max_vectors=2)
    _fill(service)
    assert service.collection("c").info()["index"] == "hnsw"
    service.delete_document("c", "paris")
    service.close()
    saved = len(index_saves)
    for _ in range(2):
        reopened = _service(tmp_path, exact_max_vectors=2)
        results = reopened.search("c", "Paris capital of France Eiffel", 20, "dense")
        assert "paris" not in {r.document_id for r in results} and results
        reopened.close()
    assert len(index_saves) == saved

"""One named collection: its own SQLite store, FAISS index and BM25 index in its own directory.

Nothing is shared between collections but the (stateless) embedder, so a collection can later
belong to a tenant by living under that tenant's directory. Every public method takes the
collection's lock: the HTTP server calls them from executor threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.errors import InvalidRequest, NotFound
from jaxserve.rag.bm25 import BM25Index
from jaxserve.rag.chunking import chunk_document
from jaxserve.rag.config import SEARCH_MODES, RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.embedder import Embedder
from jaxserve.rag.fusion import reciprocal_rank_fusion
from jaxserve.rag.store import DocumentChunks, Store
from jaxserve.rag.vector_index import VectorIndex

STORE_FILE = "store.sqlite3"
INDEX_FILE = "vectors.faiss"
# The index file is rewritten once this many chunks changed, or this fraction of the index.
_MIN_UNSAVED = 1024
_UNSAVED_FRACTION = 0.1


@dataclass(frozen=True)
class SearchResult:
    document_id: str
    chunk_id: str  # "<document id>#<chunk index>": stable while the document is unchanged
    text: str
    score: float  # dense: cosine similarity; bm25: BM25 score; hybrid: fused RRF score
    metadata: dict
    start: int  # character offsets of `text` in the document
    end: int

    def to_dict(self) -> dict:
        return {"document_id": self.document_id, "chunk_id": self.chunk_id, "text": self.text,
                "score": self.score, "metadata": self.metadata, "start": self.start,
                "end": self.end}


def check_search_args(query, top_k, mode, max_top_k: int) -> None:
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("'query' must be a non-empty string", param="query")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= max_top_k:
        raise InvalidRequest(f"'top_k' must be an integer in [1, {max_top_k}], got {top_k!r}",
                             param="top_k")
    if mode not in SEARCH_MODES:
        raise InvalidRequest(f"'mode' must be one of {', '.join(SEARCH_MODES)}, got {mode!r}",
                             param="mode")


class Collection:
    def __init__(self, name: str, directory: Path, embedder: Embedder, config: RagConfig):
        self.name = name
        self.directory = directory
        self.embedder = embedder
        self.config = config
        self._lock = threading.Lock()
        directory.mkdir(parents=True, exist_ok=True)
        self._store = Store(directory / STORE_FILE)
        self._index = VectorIndex(embedder.dim, config.index)
        index_path = directory / INDEX_FILE
        self._unsaved = 0  # chunks added or removed since the index file was written
        if index_path.exists():
            self._index_changed(self._index.load(index_path, self._store.live_ids(),
                                                 self._all_vectors))
        else:
            self._index.rebuild(*self._all_vectors())
            self._index_changed(self._index.num_live)
        self._bm25: BM25Index | None = None  # built on the first lexical search after a change

    def _all_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        return self._store.all_vectors(self.embedder.dim)

    def _index_changed(self, num_chunks: int) -> None:
        """Write the index file once the changes since the last write reach a fraction of the
        index, not after every upsert: rewriting a 100k-chunk HNSW file takes ~0.4 s, which made
        adding documents one at a time quadratic. The store commits every change, and loading
        adds what the file lacks, so a crash costs only that catch-up."""
        self._unsaved += num_chunks
        if self._unsaved >= max(_MIN_UNSAVED, _UNSAVED_FRACTION * self._index.num_live):
            self._save_index()

    def _save_index(self) -> None:
        self._index.save(self.directory / INDEX_FILE)
        self._unsaved = 0

    def close(self, save: bool = True) -> None:
        """Close the store, first writing the index if it changed (not when the collection is
        about to be deleted)."""
        with self._lock:
            if save and self._unsaved:
                self._save_index()
            self._store.close()

    def info(self) -> dict:
        with self._lock:
            docs, chunks = self._store.counts()
            return {"name": self.name, "documents": docs, "chunks": chunks,
                    "index": self._index.kind}

    def upsert(self, documents: list[Document]) -> int:
        """Insert or replace documents by id; returns how many chunks were embedded."""
        chunked = [(doc, chunk_document(doc.id, doc.text, self.embedder.token_spans,
                                        self.config.chunker, doc.metadata)) for doc in documents]
        vectors, _ = self.embedder.embed([c.text for _, chunks in chunked for c in chunks])
        prepared, start = [], 0
        for doc, chunks in chunked:
            prepared.append(DocumentChunks(doc.id, doc.text, doc.metadata, chunks,
                                           vectors[start:start + len(chunks)]))
            start += len(chunks)
        with self._lock:
            removed, added, added_vectors = self._store.upsert(prepared)
            self._index.update(removed, np.asarray(added, np.int64), added_vectors,
                               self._all_vectors)
            self._index_changed(len(removed) + len(added))
            self._bm25 = None
        return len(added)

    def delete(self, document_id: str) -> None:
        with self._lock:
            removed = self._store.delete(document_id)
            if removed is None:
                raise NotFound(f"collection {self.name!r} has no document {document_id!r}",
                               param="document_id")
            self._index.update(removed, np.zeros(0, np.int64),
                               np.zeros((0, self.embedder.dim), np.float32), self._all_vectors)
            self._index_changed(len(removed))
            self._bm25 = None

    def search(self, query: str, top_k: int = 5, mode: str = "hybrid") -> list[SearchResult]:
        check_search_args(query, top_k, mode, self.config.search.max_top_k)
        # Hybrid fuses deeper lists than it returns, so a chunk ranked well by one retriever
        # and moderately by the other can still surface.
        depth = top_k * self.config.search.candidates_per_result if mode == "hybrid" else top_k
        query_vector = self.embedder.embed([query])[0][0] if mode != "bm25" else None
        with self._lock:
            dense = self._dense(query_vector, depth) if mode != "bm25" else []
            lexical = self._lexical(query, depth) if mode != "dense" else []
            if mode == "hybrid":
                ranked = reciprocal_rank_fusion([[i for i, _ in dense], [i for i, _ in lexical]],
                                                self.config.search.rrf_k)
            else:
                ranked = dense or lexical
            ranked = ranked[:top_k]
            rows = self._store.chunks([i for i, _ in ranked])
        return [SearchResult(r.document_id, f"{r.document_id}#{r.index}", r.text, score,
                             r.metadata, r.start, r.end)
                for i, score in ranked if (r := rows.get(i)) is not None]

    def _dense(self, query_vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        if self._index.num_live == 0:
            return []
        scores, ids = self._index.search(query_vector[None], k)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def _lexical(self, query: str, k: int) -> list[tuple[int, float]]:
        if self._bm25 is None:
            self._bm25 = BM25Index(*self._store.all_texts())
        return self._bm25.search(query, k)

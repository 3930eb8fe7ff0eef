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
from jaxserve.rag.fusion import interleave, rank_documents, reciprocal_rank_fusion
from jaxserve.rag.rerank import LateInteractionReranker
from jaxserve.rag.store import DocumentChunks, Store
from jaxserve.rag.shards import ShardedIndex

STORE_FILE = "store.sqlite3"
# The index file is rewritten once this many chunks changed, or this fraction of the index.
_MIN_UNSAVED = 1024
_UNSAVED_FRACTION = 0.1


@dataclass(frozen=True)
class SearchResult:
    document_id: str
    chunk_id: str  # "<document id>#<chunk index>": stable while the document is unchanged
    text: str
    # Its document's score: dense: cosine similarity and bm25: BM25 score of its best chunk
    # (or the sum of its top_chunks best); hybrid: the fused RRF score; reranked: the reranker's.
    score: float
    metadata: dict
    start: int  # character offsets of `text` in the document
    end: int

    def to_dict(self) -> dict:
        return {"document_id": self.document_id, "chunk_id": self.chunk_id, "text": self.text,
                "score": self.score, "metadata": self.metadata, "start": self.start,
                "end": self.end}


def check_search_args(query, top_k, mode, max_top_k: int, rerank=False) -> None:
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("'query' must be a non-empty string", param="query")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= max_top_k:
        raise InvalidRequest(f"'top_k' must be an integer in [1, {max_top_k}], got {top_k!r}",
                             param="top_k")
    if mode not in SEARCH_MODES:
        raise InvalidRequest(f"'mode' must be one of {', '.join(SEARCH_MODES)}, got {mode!r}",
                             param="mode")
    if not isinstance(rerank, bool):
        raise InvalidRequest(f"'rerank' must be a boolean, got {rerank!r}", param="rerank")


class Collection:
    def __init__(self, name: str, directory: Path, embedder: Embedder, config: RagConfig,
                 reranker: LateInteractionReranker | None = None):
        self.name = name
        self.directory = directory
        self.embedder = embedder
        self.reranker = reranker
        self.config = config
        self._lock = threading.Lock()
        self._store = Store(directory / STORE_FILE)
        self._index = ShardedIndex(embedder.dim, config.index)
        self._unsaved = 0  # chunks added or removed since the index files were written
        self._index_changed(self._index.load(directory, self._store.live_chunks(),
                                             self._all_vectors))
        # Built from the store on the first lexical search, then kept up to date in place.
        self._bm25: BM25Index | None = None

    def _all_vectors(self) -> tuple[np.ndarray, list[str], np.ndarray]:
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
        self._index.save(self.directory)
        self._unsaved = 0

    def close(self, save: bool = True) -> None:
        """Close the store, first writing the index if it changed (not when the collection is
        about to be deleted)."""
        with self._lock:
            if save and self._unsaved:
                self._save_index()
            self._store.close()
            self._index.close()

    def new_documents(self, document_ids: list[str]) -> int:
        """How many of these ids the collection does not hold yet."""
        with self._lock:
            return self._store.new_documents(document_ids)

    def info(self) -> dict:
        with self._lock:
            docs, chunks = self._store.counts()
            return {"name": self.name, "documents": docs, "chunks": chunks,
                    "index": self._index.kind}

    def upsert(self, documents: list[Document]) -> tuple[int, int]:
        """Insert or replace documents by id; returns (chunks embedded, tokens the encoder
        read)."""
        chunked = [(doc, chunk_document(doc.id, doc.text, self.embedder.token_spans,
                                        self.config.chunker, doc.metadata)) for doc in documents]
        vectors, num_tokens = self.embedder.embed([c.text for _, chunks in chunked
                                                   for c in chunks])
        prepared, start = [], 0
        for doc, chunks in chunked:
            prepared.append(DocumentChunks(doc.id, doc.text, doc.metadata, chunks,
                                           vectors[start:start + len(chunks)]))
            start += len(chunks)
        with self._lock:
            removed, added, added_vectors = self._store.upsert(prepared)
            self._index.update(removed, np.asarray(added, np.int64),
                               [doc.id for doc in prepared for _ in doc.chunks], added_vectors,
                               self._all_vectors)
            self._index_changed(len(removed) + len(added))
            if self._bm25 is not None:
                self._bm25.remove([i for i, _ in removed])
                self._bm25.add(added, [c.text for _, chunks in chunked for c in chunks])
        return len(added), num_tokens

    def delete(self, document_id: str) -> None:
        with self._lock:
            removed = self._store.delete(document_id)
            if removed is None:
                raise NotFound(f"collection {self.name!r} has no document {document_id!r}",
                               param="document_id")
            self._index.update([(i, document_id) for i in removed], np.zeros(0, np.int64), [],
                               np.zeros((0, self.embedder.dim), np.float32), self._all_vectors)
            self._index_changed(len(removed))
            if self._bm25 is not None:
                self._bm25.remove(removed)

    def search(self, query: str, top_k: int = 5, mode: str = "hybrid",
               rerank: bool = False) -> list[SearchResult]:
        """The best chunks of the best documents (see fusion.interleave); with `rerank`, the
        fused top `rerank_candidates` documents are reordered by the reranker's score of their
        best chunk."""
        check_search_args(query, top_k, mode, self.config.search.max_top_k, rerank)
        if rerank and self.reranker is None:
            raise InvalidRequest("this server has no reranker", param="rerank")
        cfg = self.config.search
        depth = max(cfg.candidates, cfg.candidates_per_result * top_k)
        query_vector = self.embedder.embed([query])[0][0] if mode != "bm25" else None
        with self._lock:
            dense = self._dense(query_vector, depth) if mode != "bm25" else []
            lexical = self._lexical(query, depth) if mode != "dense" else []
            rows = self._store.chunks(list({i for i, _ in dense + lexical}))
            document_of = {i: r.document_id for i, r in rows.items()}
            num_chunks, openings = self._store.document_shape(list(set(document_of.values())))
        dense_documents = rank_documents(dense, document_of, cfg.top_chunks,
                                         cfg.dense_length_penalty, num_chunks)
        lexical_documents = rank_documents(lexical, document_of, cfg.top_chunks,
                                           cfg.bm25_length_penalty, num_chunks)
        if mode == "hybrid":
            opening = {d: float(np.frombuffer(v, np.float32) @ query_vector)
                       for d, v in openings.items()}
            weights = [cfg.dense_weight, cfg.bm25_weight, cfg.opening_weight]
            documents = reciprocal_rank_fusion(
                [[d for d, _ in dense_documents], [d for d, _ in lexical_documents],
                 sorted(opening, key=lambda d: -opening[d])], cfg.rrf_k, weights)
            chunk_order = [i for i, _ in reciprocal_rank_fusion(
                [[i for i, _ in dense], [i for i, _ in lexical]], cfg.rrf_k, weights[:2])]
        else:
            documents = dense_documents or lexical_documents
            chunk_order = [i for i, _ in dense or lexical]
        if rerank:
            documents = self._rerank(query, documents, chunk_order, document_of, rows)
        return [SearchResult(rows[i].document_id, f"{rows[i].document_id}#{rows[i].index}",
                             rows[i].text, score, rows[i].metadata, rows[i].start, rows[i].end)
                for i, score in interleave(documents, chunk_order, document_of, top_k)]

    def _rerank(self, query: str, documents: list[tuple[str, float]], chunk_order: list[int],
                document_of: dict[int, str], rows: dict) -> list[tuple[str, float]]:
        head = documents[:self.config.search.rerank_candidates]
        best = {d: i for d, i in ((document_of.get(i), i) for i in reversed(chunk_order))}
        scores, _ = self.reranker.score(query, [rows[best[d]].text for d, _ in head])
        order = np.argsort(-scores, kind="stable")
        return [(head[j][0], float(scores[j])) for j in order] + documents[len(head):]

    def _dense(self, query_vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        if self._index.num_live == 0:
            return []
        scores, ids = self._index.search(
            query_vector[None], k, lambda ids: self._store.vectors_of(ids, self.embedder.dim))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def _lexical(self, query: str, k: int) -> list[tuple[int, float]]:
        if self._bm25 is None:
            self._bm25 = BM25Index(*self._store.all_texts())
        return self._bm25.search(query, k)

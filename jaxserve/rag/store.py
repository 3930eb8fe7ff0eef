"""One collection's documents, chunks and chunk vectors in SQLite: the source of truth.

Chunk ids are AUTOINCREMENT row ids, never reused, so an id left in a stale FAISS file can only
name a deleted chunk, never a different one. Vectors are stored beside their chunks (float32
blobs) so an index of any kind can be rebuilt without re-embedding.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.rag.chunking import Chunk

_SCHEMA = """
PRAGMA foreign_keys = ON;
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    start INTEGER NOT NULL,
    end INTEGER NOT NULL,
    text TEXT NOT NULL,
    vector BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks(document_id);
"""


_MAX_MARKS = 500  # SQLite's bound on a statement's parameters is 999 in old builds


@dataclass(frozen=True)
class StoredChunk:
    id: int
    document_id: str
    index: int
    start: int
    end: int
    text: str
    metadata: dict


@dataclass(frozen=True)
class DocumentChunks:
    """A document ready to store: its chunks and their vectors [len(chunks), dim]."""

    id: str
    text: str
    metadata: dict
    chunks: list[Chunk]
    vectors: np.ndarray


def count_documents(path: Path) -> int:
    """The documents of a store that is not open (read-only: nothing to write back)."""
    if not path.exists():
        return 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (docs,), = db.execute("SELECT COUNT(*) FROM documents")
        return docs
    finally:
        db.close()


class Store:
    def __init__(self, path: Path):
        # Private: SQLite gives its WAL and shared-memory files the database file's mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        # Used from executor threads, always under the owning collection's lock.
        self._db = sqlite3.connect(str(path), check_same_thread=False)
        self._db.executescript(_SCHEMA)
        self._db.execute("PRAGMA journal_mode = WAL")

    def close(self) -> None:
        self._db.close()

    def upsert(self, documents: list[DocumentChunks]
               ) -> tuple[list[tuple[int, str]], list[int], np.ndarray]:
        """Replace or insert documents in one transaction: (removed (chunk id, document id)
        pairs, new chunk ids in the documents' chunk order, their vectors)."""
        removed, added, vectors = [], [], []
        with self._db:
            for doc in documents:
                removed += [(i, doc.id) for i in self._chunk_ids(doc.id)]
                self._db.execute("DELETE FROM documents WHERE id = ?", (doc.id,))
                self._db.execute("INSERT INTO documents VALUES (?, ?, ?)",
                                 (doc.id, doc.text, json.dumps(doc.metadata)))
                for chunk, vector in zip(doc.chunks, doc.vectors):
                    cur = self._db.execute(
                        "INSERT INTO chunks (document_id, idx, start, end, text, vector) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (doc.id, chunk.index, chunk.start, chunk.end, chunk.text,
                         np.asarray(vector, np.float32).tobytes()))
                    added.append(cur.lastrowid)
                    vectors.append(vector)
        dim = documents[0].vectors.shape[1] if documents else 0
        return removed, added, np.asarray(vectors, np.float32).reshape(len(added), dim)

    def _chunk_ids(self, document_id: str) -> list[int]:
        rows = self._db.execute("SELECT id FROM chunks WHERE document_id = ?", (document_id,))
        return [r[0] for r in rows]

    def delete(self, document_id: str) -> list[int] | None:
        """The deleted document's chunk ids, or None when there is no such document."""
        with self._db:
            ids = self._chunk_ids(document_id)
            cur = self._db.execute("DELETE FROM documents WHERE id = ?", (document_id,))
        return ids if cur.rowcount else None

    def chunks(self, ids: list[int]) -> dict[int, StoredChunk]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self._db.execute(
            f"SELECT c.id, c.document_id, c.idx, c.start, c.end, c.text, d.metadata "
            f"FROM chunks c JOIN documents d ON d.id = c.document_id WHERE c.id IN ({marks})",
            [int(i) for i in ids])
        return {r[0]: StoredChunk(*r[:6], json.loads(r[6])) for r in rows}

    def document_shape(self, document_ids: list[str]) -> tuple[dict[str, int], dict[str, bytes]]:
        """(number of chunks, vector of the opening chunk as float32 bytes) per document."""
        if not document_ids:
            return {}, {}
        marks = ",".join("?" * len(document_ids))
        counts = dict(self._db.execute(
            f"SELECT document_id, COUNT(*) FROM chunks WHERE document_id IN ({marks}) "
            f"GROUP BY document_id", document_ids))
        openings = dict(self._db.execute(
            f"SELECT document_id, vector FROM chunks WHERE idx = 0 AND document_id IN ({marks})",
            document_ids))
        return counts, openings

    def vectors_of(self, ids: np.ndarray, dim: int) -> np.ndarray:
        """The vectors [len(ids), dim] of these live chunk ids, in their order."""
        ids = [int(i) for i in ids]
        marks = ",".join("?" * len(ids))
        found = dict(self._db.execute(f"SELECT id, vector FROM chunks WHERE id IN ({marks})", ids))
        return np.frombuffer(b"".join(found[i] for i in ids), np.float32).reshape(len(ids), dim)

    def live_chunks(self) -> dict[int, str]:
        """chunk id -> document id, of every chunk."""
        return dict(self._db.execute("SELECT id, document_id FROM chunks"))

    def all_vectors(self, dim: int) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(chunk ids, their document ids, their vectors [N, dim]) in id order."""
        rows = self._db.execute("SELECT id, document_id, vector FROM chunks ORDER BY id").fetchall()
        ids = np.array([r[0] for r in rows], np.int64)
        vectors = np.frombuffer(b"".join(r[2] for r in rows), np.float32).reshape(len(rows), dim)
        return ids, [r[1] for r in rows], vectors

    def all_texts(self) -> tuple[list[int], list[str]]:
        rows = self._db.execute("SELECT id, text FROM chunks ORDER BY id").fetchall()
        return [r[0] for r in rows], [r[1] for r in rows]

    def new_documents(self, document_ids: list[str]) -> int:
        """How many of these ids the store does not hold yet."""
        known = set()
        for start in range(0, len(document_ids), _MAX_MARKS):
            part = document_ids[start:start + _MAX_MARKS]
            known.update(r[0] for r in self._db.execute(
                f"SELECT id FROM documents WHERE id IN ({','.join('?' * len(part))})", part))
        return len(set(document_ids) - known)

    def counts(self) -> tuple[int, int]:
        """(documents, chunks)."""
        (docs,), = self._db.execute("SELECT COUNT(*) FROM documents")
        (chunks,), = self._db.execute("SELECT COUNT(*) FROM chunks")
        return docs, chunks

"""A collection's vectors split across index shards: one VectorIndex (and one file) per shard,
searched in parallel and merged.

A document's chunks all live in shard `shard_of(document_id)`, a stable hash (BLAKE2b of the id,
not Python's per-process `hash`), so a document's route is the same in every process and after
every restart, and replacing or deleting a document touches one shard. Each shard picks its own
kind (exact / HNSW / IVF-PQ) by its own size. FAISS releases the GIL while it searches, so the
shards' searches run on a thread pool in parallel; their top-k lists merge into the exact top-k
of the union (ties broken by chunk id).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxserve.rag.config import IndexConfig
from jaxserve.rag.vector_index import VectorIndex


def shard_of(document_id: str, num_shards: int) -> int:
    digest = hashlib.blake2b(document_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def shard_files(directory: Path, num_shards: int) -> list[Path]:
    if num_shards == 1:
        return [directory / "vectors.faiss"]  # the layout of unsharded collections
    return [directory / f"vectors.{i}-of-{num_shards}.faiss" for i in range(num_shards)]


def merge_top_k(scores: list[np.ndarray], ids: list[np.ndarray],
                k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of several [Q, k_i] result lists per query row (missing ids are -1)."""
    scores, ids = np.concatenate(scores, axis=1), np.concatenate(ids, axis=1)
    scores = np.where(ids < 0, -np.inf, scores)
    out_scores = np.full((len(ids), k), -np.inf, np.float32)
    out_ids = np.full((len(ids), k), -1, np.int64)
    for row in range(len(ids)):
        order = np.lexsort((ids[row], -scores[row]))[:k]
        out_scores[row, :len(order)], out_ids[row, :len(order)] = scores[row, order], \
            ids[row, order]
    return out_scores, np.where(np.isneginf(out_scores), -1, out_ids)


class ShardedIndex:
    """The index side of a collection. `all_vectors()` -> (chunk ids, document ids, vectors) of
    every live chunk: read only when a shard is rebuilt or a file lacks chunks."""

    def __init__(self, dim: int, config: IndexConfig):
        self.dim = dim
        self.config = config
        self.shards = [VectorIndex(dim, config) for _ in range(config.num_shards)]
        self._pool = ThreadPoolExecutor(config.num_shards, "shard") \
            if config.num_shards > 1 else None

    @property
    def kind(self) -> str:
        """The shards' kinds, e.g. "exact" or "exact+hnsw" while they differ."""
        return "+".join(sorted({s.kind for s in self.shards}))

    @property
    def num_live(self) -> int:
        return sum(s.num_live for s in self.shards)

    def _route(self, documents) -> np.ndarray:
        return np.array([shard_of(d, len(self.shards)) for d in documents], np.int64)

    def _per_shard(self, all_vectors):
        """shard -> a callable returning all_vectors() narrowed to that shard; the store is read
        at most once for all of them."""
        cache = []

        def for_shard(shard: int):
            def read() -> tuple[np.ndarray, np.ndarray]:
                if not cache:
                    ids, documents, vectors = all_vectors()
                    cache.append((ids, self._route(documents), vectors))
                ids, routes, vectors = cache[0]
                return ids[routes == shard], vectors[routes == shard]
            return read
        return for_shard

    def rebuild(self, ids: np.ndarray, documents, vectors: np.ndarray) -> None:
        routes = self._route(documents)
        for i, shard in enumerate(self.shards):
            shard.rebuild(ids[routes == i], vectors[routes == i])

    def update(self, removed: list[tuple[int, str]], added_ids: np.ndarray, added_documents,
               added_vectors: np.ndarray, all_vectors) -> None:
        """Follow a change the store has committed: `removed` (chunk id, document id) pairs are
        gone, `added_ids` (of `added_documents`) are new."""
        removed_routes = self._route([d for _, d in removed])
        added_routes = self._route(added_documents)
        for_shard = self._per_shard(all_vectors)
        for i, shard in enumerate(self.shards):
            gone = [c for (c, _), r in zip(removed, removed_routes) if r == i]
            new = added_routes == i
            if gone or new.any():
                shard.update(gone, added_ids[new], added_vectors[new], for_shard(i))

    def search(self, queries: np.ndarray, k: int,
               vectors_of=None) -> tuple[np.ndarray, np.ndarray]:
        """(scores [Q, k'], ids [Q, k']), k' = min(k, live chunks); missing ids are -1.
        `vectors_of`: see VectorIndex.search."""
        live = [s for s in self.shards if s.num_live]
        k = max(1, min(k, self.num_live))
        if len(live) == 1:
            results = [live[0].search(queries, k, vectors_of)]
        else:
            results = list(self._pool.map(lambda s: s.search(queries, k, vectors_of), live))
        # Merged from one shard too: equal scores then come in id order whatever the shard count
        # (FAISS's own order of ties differed, and on some hosts two chunks score exactly alike).
        return merge_top_k([s for s, _ in results], [i for _, i in results], k)

    def save(self, directory: Path) -> None:
        for shard, path in zip(self.shards, shard_files(directory, len(self.shards))):
            shard.save(path)

    def load(self, directory: Path, live: dict[int, str], all_vectors) -> int:
        """Read the shard files and reconcile each with the store (VectorIndex.load); a shard
        without a file (a new collection, or one reopened with another shard count) is built
        from the store. Returns how far the files are behind."""
        routes = dict(zip(live, self._route(live.values()).tolist()))
        for_shard, behind = self._per_shard(all_vectors), 0
        for i, (shard, path) in enumerate(zip(self.shards,
                                              shard_files(directory, len(self.shards)))):
            read = for_shard(i)
            if path.exists():
                behind += shard.load(path, {c for c, r in routes.items() if r == i}, read)
            else:
                shard.rebuild(*read())
                behind += shard.num_live
        return behind

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

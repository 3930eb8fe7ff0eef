"""FAISS inner-product index over chunk ids: exact below a size, HNSW above, IVF-PQ past a larger
one, GPU when present (exact only).

Vectors are L2-normalised, so inner product is cosine similarity. Ids are the store's chunk row ids
(never reused): IndexIDMap2 maps them for exact and HNSW, IVF lists hold them themselves. Exact and
IVF-PQ indexes delete for real; FAISS' HNSW cannot remove
points, so deleted ids there become tombstones that an IDSelector filters out of every search, and
the graph is rebuilt once tombstones pass a quarter of it (or when the size calls for another
kind). The store holds every live vector, so
any index can be rebuilt from it; the saved file is a cache of that work, and loading it brings it
level with the store.
"""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np

from jaxserve.rag.config import IndexConfig

_REBUILD_TOMBSTONE_FRACTION = 0.25


def _refine(queries: np.ndarray, candidates: np.ndarray, vectors_of,
            k: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact top k of each query's candidate ids (-1: none)."""
    scores = np.full((len(queries), k), -np.inf, np.float32)
    ids = np.full((len(queries), k), -1, np.int64)
    for row, (query, found) in enumerate(zip(queries, candidates, strict=True)):
        found = found[found >= 0]
        exact = vectors_of(found) @ query
        best = np.argsort(-exact, kind="stable")[:k]
        scores[row, :len(best)], ids[row, :len(best)] = exact[best], found[best]
    return scores, ids


class VectorIndex:
    def __init__(self, dim: int, config: IndexConfig):
        self.dim = dim
        self.config = config
        self._cpu: faiss.Index = self._new(np.zeros((0, dim), np.float32))
        self._device = None  # a GPU copy of an exact index, searched instead of _cpu
        self._tombstones: set[int] = set()
        self._selector: tuple | None = None  # (IDSelectorBatch, IDSelectorNot) of _tombstones

    @property
    def kind(self) -> str:
        if isinstance(self._cpu, faiss.IndexIVF):
            return "ivfpq"
        return "hnsw" if isinstance(faiss.downcast_index(self._cpu.index), faiss.IndexHNSW) \
            else "exact"

    @property
    def ids(self) -> np.ndarray:
        if self.kind != "ivfpq":
            return faiss.vector_to_array(self._cpu.id_map)
        lists = self._cpu.invlists
        return np.concatenate([np.zeros(0, np.int64)] + [
            faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
            for i in range(self._cpu.nlist) if lists.list_size(i)])

    @property
    def num_live(self) -> int:
        return self._cpu.ntotal - len(self._tombstones)

    def _kind_for(self, num_vectors: int) -> str:
        if num_vectors <= self.config.exact_max_vectors:
            return "exact"
        return "hnsw" if num_vectors < self.config.ivfpq_min_vectors else "ivfpq"

    def _new(self, vectors: np.ndarray) -> faiss.Index:
        """An empty index of the kind for this many vectors (IVF-PQ trained on them)."""
        kind = self._kind_for(len(vectors))
        if kind == "exact":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        if kind == "hnsw":
            inner = faiss.IndexHNSWFlat(self.dim, self.config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = self.config.hnsw_ef_construction
            return faiss.IndexIDMap2(inner)
        lists = self.config.ivf_lists or int(4 * len(vectors) ** 0.5)
        index = faiss.index_factory(self.dim, f"IVF{lists},PQ{self.config.pq_subquantizers}",
                                    faiss.METRIC_INNER_PRODUCT)
        # FAISS' advice: 30-256 training points per list; more buys nothing but time.
        sample = np.random.default_rng(0).choice(len(vectors), min(len(vectors), 64 * lists),
                                                 replace=False)
        index.train(np.ascontiguousarray(vectors[np.sort(sample)], np.float32))
        return index

    def _sync_device(self) -> None:
        self._device = None
        if self.config.use_gpu and self.kind == "exact" and faiss.get_num_gpus() > 0:
            self._device = faiss.index_cpu_to_all_gpus(self._cpu)

    def rebuild(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Replace the whole index by these vectors, choosing the kind for their number."""
        self._cpu = self._new(vectors)
        self._tombstones, self._selector = set(), None
        if len(ids):
            self._cpu.add_with_ids(np.ascontiguousarray(vectors, np.float32),
                                   np.asarray(ids, np.int64))
        self._sync_device()

    def update(self, removed, added_ids: np.ndarray, added_vectors: np.ndarray,
               all_vectors) -> None:
        """Follow a change the store has already committed: `removed` chunk ids are gone and
        `added_ids` are new. `all_vectors()` -> (ids, vectors) of every live chunk, read only when
        the index is rebuilt instead: when the collection's size calls for the other kind, or
        when HNSW tombstones would pass a quarter of the graph."""
        removed = np.asarray(sorted(removed), np.int64)
        live = self.num_live - len(removed) + len(added_ids)
        rebuild = self._kind_for(live) != self.kind
        if self.kind == "hnsw":
            tombstones = len(self._tombstones) + len(removed)
            graph = self._cpu.ntotal + len(added_ids)
            rebuild |= tombstones > _REBUILD_TOMBSTONE_FRACTION * graph
        if rebuild:
            self.rebuild(*all_vectors())
            return
        if len(removed) and self.kind != "hnsw":
            self._cpu.remove_ids(faiss.IDSelectorBatch(removed))
        elif len(removed):
            self._tombstones.update(removed.tolist())
            self._selector = None
        if len(added_ids):
            self._cpu.add_with_ids(np.ascontiguousarray(added_vectors, np.float32),
                                   np.asarray(added_ids, np.int64))
        if len(removed) or len(added_ids):
            self._sync_device()

    def search(self, queries: np.ndarray, k: int,
               vectors_of=None) -> tuple[np.ndarray, np.ndarray]:
        """(scores [Q, k], ids [Q, k]); missing results have id -1. `vectors_of(ids)` -> their
        exact vectors [len(ids), dim]: IVF-PQ then re-scores its best `ivfpq_refine` * k
        candidates exactly (product-quantised scores alone cannot order close neighbours)."""
        queries = np.ascontiguousarray(queries, np.float32)
        k = max(1, min(k, self.num_live))
        if self.kind == "exact":
            index = self._cpu if self._device is None else self._device
            return index.search(queries, k)
        if self.kind == "ivfpq":
            params = faiss.SearchParametersIVF(nprobe=self.config.ivf_nprobe)
            if vectors_of is None or self.config.ivfpq_refine <= 1:
                return self._cpu.search(queries, k, params=params)
            _, candidates = self._cpu.search(
                queries, min(self.num_live, k * self.config.ivfpq_refine), params=params)
            return _refine(queries, candidates, vectors_of, k)
        params = faiss.SearchParametersHNSW(efSearch=max(self.config.hnsw_ef_search, k))
        if self._tombstones:
            params.sel = self._tombstone_selector()
        return self._cpu.search(queries, k, params=params)

    def _tombstone_selector(self) -> faiss.IDSelector:
        # Built once per set of tombstones (rebuilding it per query costs more than the search).
        # The batch selector is kept too: FAISS holds only a raw pointer to it.
        if self._selector is None:
            dead = np.fromiter(self._tombstones, np.int64, len(self._tombstones))
            batch = faiss.IDSelectorBatch(dead)
            self._selector = (batch, faiss.IDSelectorNot(batch))
        return self._selector[1]

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        faiss.write_index(self._cpu, str(tmp))
        os.chmod(tmp, 0o600)  # a tenant's vectors: private, as its store
        os.replace(tmp, path)  # a crash mid-write leaves the previous index whole

    def load(self, path: Path, live_ids: set[int], all_vectors) -> int:
        """Read a saved index and reconcile it with the store's live ids: ids it has that the store
        deleted become deletions, ids it lacks (changes after the last save) are added. Returns
        how far the file is behind: the changes a save would record (HNSW tombstones are not
        among them: they are re-derived at every load), or every id after a rebuild."""
        self._cpu = faiss.read_index(str(path))
        self._tombstones, self._selector = set(), None
        indexed = set(self.ids.tolist())
        added_ids, added_vectors = np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        if missing := live_ids - indexed:
            ids, vectors = all_vectors()
            take = np.isin(ids, np.fromiter(missing, np.int64, len(missing)))
            added_ids, added_vectors = ids[take], vectors[take]
        removed = indexed - live_ids
        self._sync_device()
        loaded = self._cpu
        self.update(removed, added_ids, added_vectors, all_vectors)
        if self._cpu is not loaded:  # rebuilt (another kind, or too many tombstones)
            return self.num_live
        return len(added_ids) + (len(removed) if self.kind != "hnsw" else 0)

"""VectorIndex on its own: exact vs HNSW, updates, tombstones, rebuilds, save and reconcile."""

from __future__ import annotations

import numpy as np

from jaxserve.rag.config import IndexConfig
from jaxserve.rag.vector_index import VectorIndex

DIM = 8


class Store:
    """The live chunks, as the SQLite store holds them (plain dict here: the index's contract)."""

    def __init__(self):
        self.vectors: dict[int, np.ndarray] = {}
        self.rng = np.random.default_rng(0)
        self.next_id = 1

    def add(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        x = self.rng.normal(size=(n, DIM)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        self.vectors.update(zip(ids.tolist(), x))
        return ids, x

    def remove(self, ids) -> list[int]:
        for i in ids:
            del self.vectors[i]
        return list(ids)

    def all(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.array(sorted(self.vectors), np.int64)
        return ids, np.array([self.vectors[i] for i in ids.tolist()], np.float32).reshape(-1, DIM)


def _found(index: VectorIndex, store: Store) -> list[int]:
    _, ids = index.search(store.rng.normal(size=(1, DIM)).astype(np.float32), 1000)
    return [i for i in ids[0].tolist() if i >= 0]


def test_exact_search_finds_each_vector_first():
    store, index = Store(), VectorIndex(DIM, IndexConfig())
    index.update([], *store.add(50), store.all)
    scores, ids = index.search(np.stack([store.vectors[i] for i in (3, 17)]), 1)
    assert index.kind == "exact" and ids[:, 0].tolist() == [3, 17]
    np.testing.assert_allclose(scores[:, 0], 1.0, rtol=1e-5)


def test_kind_follows_size_and_every_live_id_is_found_once():
    store, index = Store(), VectorIndex(DIM, IndexConfig(exact_max_vectors=20))
    index.update([], *store.add(15), store.all)
    assert index.kind == "exact"
    index.update([], *store.add(10), store.all)  # 25 > 20: rebuilt as HNSW
    assert index.kind == "hnsw"
    index.update(store.remove([1, 2, 3]), *store.add(2), store.all)  # tombstones
    found = _found(index, store)
    assert sorted(found) == sorted(store.vectors) and len(found) == len(set(found))
    # Many deletions at once: past a quarter of the graph, rebuilt (here back to exact).
    index.update(store.remove(list(store.vectors)[:10]), np.zeros(0, np.int64),
                 np.zeros((0, DIM)), store.all)
    assert index.kind == "exact" and index.num_live == len(store.vectors) == 14
    found = _found(index, store)
    assert sorted(found) == sorted(store.vectors)


def test_a_rebuild_during_an_update_does_not_add_twice():
    store, index = Store(), VectorIndex(DIM, IndexConfig(exact_max_vectors=4))
    index.update([], *store.add(8), store.all)
    # Replacing 3 of 8 makes 3 tombstones > 25% of 11: the rebuild already holds the new ones.
    index.update(store.remove([1, 2, 3]), *store.add(3), store.all)
    found = _found(index, store)
    assert sorted(found) == sorted(store.vectors) and len(found) == 8 == index.num_live


def test_save_and_reconcile_with_the_store(tmp_path):
    path = tmp_path / "v.faiss"
    for config in (IndexConfig(), IndexConfig(exact_max_vectors=4)):
        store, index = Store(), VectorIndex(DIM, config)
        index.update([], *store.add(10), store.all)
        index.save(path)
        # After the save: one chunk deleted (stale in the file), then two added (missing).
        store.remove([4])
        reloaded = VectorIndex(DIM, config)
        reloaded.load(path, set(store.vectors), store.all)
        assert sorted(_found(reloaded, store)) == sorted(store.vectors)
        store.add(2)
        reloaded.load(path, set(store.vectors), store.all)
        assert sorted(_found(reloaded, store)) == sorted(store.vectors)


def test_ivfpq_past_its_size_deletes_for_real_and_reconciles(tmp_path):
    config = IndexConfig(exact_max_vectors=20, ivfpq_min_vectors=300, ivf_lists=8,
                         ivf_nprobe=8, pq_subquantizers=4)  # nprobe = every list: no misses
    store, index = Store(), VectorIndex(DIM, config)
    index.update([], *store.add(200), store.all)
    assert index.kind == "hnsw"
    index.update([], *store.add(150), store.all)  # 350 >= 300: rebuilt and trained as IVF-PQ
    assert index.kind == "ivfpq" and index.num_live == 350
    index.update(store.remove([5, 6, 7]), *store.add(5), store.all)  # real removal, no rebuild
    found = _found(index, store)
    assert sorted(found) == sorted(store.vectors) and index.num_live == 352
    assert sorted(index.ids.tolist()) == sorted(store.vectors)
    # With exact vectors to re-score its candidates, the top 5 is the exact top 5.
    query = store.rng.normal(size=(1, DIM)).astype(np.float32)
    ids, vectors = store.all()
    exact = ids[np.argsort(-(vectors @ query[0]))[:5]]
    scores, found = index.search(query, 5, lambda some: np.stack([store.vectors[int(i)]
                                                                   for i in some]))
    assert found[0].tolist() == exact.tolist()
    np.testing.assert_allclose(scores[0], np.sort(vectors @ query[0])[::-1][:5], rtol=1e-5)
    path = tmp_path / "v.faiss"
    index.save(path)
    store.remove([10])
    store.add(1)
    reloaded = VectorIndex(DIM, config)
    assert reloaded.load(path, set(store.vectors), store.all) == 2  # one deletion, one addition
    assert reloaded.kind == "ivfpq" and sorted(_found(reloaded, store)) == sorted(store.vectors)

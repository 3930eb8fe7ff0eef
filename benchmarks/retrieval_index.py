"""Index benchmarks (run by benchmarks/retrieval.py, or alone): FAISS recall@10 and QPS against
exact search per index kind, and sharded vs unsharded search.

    python benchmarks/retrieval_index.py [--vectors 100000] [--queries 1000]
                                         [--scale-vectors 1000000] [--scale-queries 200]

All vectors are synthetic (no text is embedded: embedding 1M chunks would take ~8 h on this CPU):
clustered unit vectors, d=384, 200 overlapping Gaussian clusters (uniformly random vectors have
no neighbourhood structure and say nothing about real embeddings); ground truth by exact search;
queries are fresh draws from the same clusters. Rows print as markdown tables.
- `--vectors`: exact vs HNSW (efSearch sweep; 10% deleted through tombstones).
- `--scale-vectors`: exact vs IVF-PQ (nprobe sweep), and a collection's ShardedIndex with 1 vs
  4 exact shards searched in parallel (same vectors, documents routed by their id's hash).
FAISS GPU is measured only where faiss.get_num_gpus() > 0; otherwise that row says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.rag.config import IndexConfig  # noqa: E402
from jaxserve.rag.shards import ShardedIndex  # noqa: E402
from jaxserve.rag.vector_index import VectorIndex  # noqa: E402


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _clustered(n: int, dim: int, centers: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Noise as large as the centres (norm ~1 each): clusters overlap, as topics do in real
    # embeddings, so the nearest neighbours are not simply "the rest of my cluster". Made in
    # blocks of float32: 1M x 384 float64 temporaries would take 3 GB.
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, 65536):
        m = min(65536, n - start)
        x = centers[rng.integers(0, len(centers), m)] + rng.normal(0, 1 / dim ** 0.5, (m, dim))
        out[start:start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def _qps(index, queries: np.ndarray, k: int,
         vectors_of=None) -> tuple[np.ndarray, float, float]:
    """(ids, QPS with all queries in one call, QPS one query per call on one thread)."""
    batch_s = best_of(lambda: index.search(queries, k, vectors_of))
    _, ids = index.search(queries, k, vectors_of)
    one = queries[:200]
    # One query has little to split across threads, and OpenMP's barriers cost ~10x on a loaded
    # machine: a server answering single queries runs them on one thread each.
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    single_s = best_of(lambda: [index.search(q[None], k, vectors_of) for q in one])
    faiss.omp_set_num_threads(threads)
    return ids, len(queries) / batch_s, len(one) / single_s


def _built(dim: int, config: IndexConfig, ids, vectors, kind: str) -> tuple[VectorIndex, float]:
    """A VectorIndex of these vectors, and the seconds its build took."""
    index = VectorIndex(dim, config)
    t0 = time.perf_counter()
    index.rebuild(ids, vectors)
    assert index.kind == kind, (index.kind, kind)
    return index, time.perf_counter() - t0


def _sweep(index: VectorIndex, field: str, values, queries, truth, k: int, label: str,
           baseline_qps: float | None = None, vectors_of=None) -> None:
    """One row per value of an IndexConfig search field; `label` has a {} for the value."""
    config = index.config
    for value in values:
        index.config = dataclasses.replace(config, **{field: value})
        found, batch_qps, single_qps = _qps(index, queries, k, vectors_of)
        ratio = f" {single_qps / baseline_qps:.1f} |" if baseline_qps else ""
        print(f"| {label.format(value)} | {_recall(found, truth):.3f} | {batch_qps:.0f} | "
              f"{single_qps:.0f} |{ratio}")
    index.config = config


def _data(n: int, num_queries: int, dim: int, seed: int):
    """(ids, vectors, queries): n clustered vectors and fresh queries from the same clusters."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 1 / dim ** 0.5, (200, dim))
    vectors = _clustered(n, dim, centers, rng)
    return np.arange(n, dtype=np.int64), vectors, _clustered(num_queries, dim, centers, rng)


def bench_faiss(n: int, num_queries: int, dim: int = 384, k: int = 10) -> None:
    ids, vectors, queries = _data(n, num_queries, dim, seed=0)
    rng = np.random.default_rng(2)
    print(f"\n### FAISS: {n} clustered vectors, d={dim}, {num_queries} queries, recall@{k} vs "
          f"exact, {faiss.omp_get_max_threads()} OpenMP threads\n")
    print("| index | build s | recall@10 | QPS (batch of all queries) "
          "| QPS (1 query/call, 1 thread) |")
    print("|---|---|---|---|---|")
    exact, build = _built(dim, IndexConfig(exact_max_vectors=n), ids, vectors, "exact")
    truth, batch_qps, single_qps = _qps(exact, queries, k)
    print(f"| exact (IndexIDMap2 + IndexFlatIP) | {build:.2f} | 1.000 | {batch_qps:.0f} | "
          f"{single_qps:.0f} |")
    config = IndexConfig(exact_max_vectors=1)
    hnsw, build = _built(dim, config, ids, vectors, "hnsw")
    _sweep(hnsw, "hnsw_ef_search", (16, 32, 64, 128, 256), queries, truth, k,
           f"HNSW M={config.hnsw_m} efConstruction={config.hnsw_ef_construction} efSearch={{}}"
           f" | {build:.1f}")
    # 10% deleted: tombstones filtered by an IDSelector during the graph search.
    dead = rng.choice(n, n // 10, replace=False)
    live = np.setdiff1d(ids, dead)
    nothing = np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    for index in (hnsw, exact):
        index.update(dead, *nothing, lambda: (live, vectors[live]))
    assert hnsw.kind == "hnsw"  # 10% stays under the rebuild threshold: tombstones
    truth, _, _ = _qps(exact, queries, k)
    found, batch_qps, single_qps = _qps(hnsw, queries, k)
    assert not set(found.ravel()) & set(dead.tolist())
    print(f"| HNSW efSearch={config.hnsw_ef_search}, 10% deleted (tombstones) | - | "
          f"{_recall(found, truth):.3f} | {batch_qps:.0f} | {single_qps:.0f} |")


def bench_scale(n: int, num_queries: int, shards: bool = True, dim: int = 384,
                k: int = 10) -> None:
    """IVF-PQ and shards at n vectors. At most one index of full vectors is alive at a time
    (1M x 384 float32 = 1.5 GB each, beside the 1.5 GB of vectors)."""
    ids, vectors, queries = _data(n, num_queries, dim, seed=1)
    print(f"\n### FAISS at scale: {n} clustered vectors, d={dim}, {num_queries} queries, "
          f"recall@{k} vs exact, {faiss.omp_get_max_threads()} OpenMP threads\n")
    print("| index | build s | recall@10 | QPS (batch of all queries) "
          "| QPS (1 query/call, 1 thread) | ratio to exact (1 query/call) |")
    print("|---|---|---|---|---|---|")
    exact, build = _built(dim, IndexConfig(exact_max_vectors=n, ivfpq_min_vectors=n + 1), ids,
                          vectors, "exact")
    truth, batch_qps, exact_single = _qps(exact, queries, k)
    print(f"| exact (IndexFlatIP) | {build:.1f} | 1.000 | {batch_qps:.0f} | {exact_single:.1f} "
          f"| 1.00 |")
    del exact
    lists = int(n ** 0.5)
    for pq in (48, 96):
        config = IndexConfig(exact_max_vectors=1, ivfpq_min_vectors=2, ivf_lists=lists,
                             pq_subquantizers=pq)
        ivf, build = _built(dim, config, ids, vectors, "ivfpq")
        label = f"IVF{lists},PQ{pq}"
        _sweep(ivf, "ivf_nprobe", (8, 32, 128), queries, truth, k,
               f"{label} nprobe={{}}, PQ scores only | {build:.0f}", exact_single)
        # The collection's search: the refine * k best PQ candidates re-scored with exact
        # vectors (read from SQLite there; from this array here, ids being row numbers).
        for refine in (10, 50):
            ivf.config = dataclasses.replace(config, ivfpq_refine=refine)
            _sweep(ivf, "ivf_nprobe", (8, 32), queries, truth, k,
                   f"{label} nprobe={{}}, refine x{refine} | {build:.0f}", exact_single,
                   vectors_of=lambda found: vectors[found])
        del ivf
    print("| FAISS GPU (exact, IVF-PQ) | - | not measured | not measured | not measured | - |"
          if faiss.get_num_gpus() == 0 else "| FAISS GPU | GPU present: run with use_gpu |")
    if shards:
        bench_shards(ids, vectors, queries, truth, k)


def bench_shards(ids, vectors, queries, truth, k: int) -> None:
    documents = [f"doc-{i}" for i in range(len(ids))]
    n, dim = vectors.shape
    print(f"\n### Sharded collection index: {n} vectors, exact shards searched in parallel "
          f"(thread pool, FAISS releases the GIL), merged top-{k}\n")
    print("| shards | build s | recall@10 vs one index | QPS (batch) | QPS (1 query/call, "
          "1 OpenMP thread per shard) | ratio to 1 shard |")
    print("|---|---|---|---|---|---|")
    base = None
    for num_shards in (1, 4):
        index = ShardedIndex(dim, IndexConfig(exact_max_vectors=n, ivfpq_min_vectors=n + 1,
                                              num_shards=num_shards))
        t0 = time.perf_counter()
        index.rebuild(ids, documents, vectors)
        build = time.perf_counter() - t0
        found, batch_qps, single_qps = _qps(index, queries, k)
        base = base or single_qps
        print(f"| {num_shards} | {build:.1f} | {_recall(found, truth):.3f} | {batch_qps:.0f} | "
              f"{single_qps:.1f} | {single_qps / base:.2f} |")
        index.close()
        del index


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vectors", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--scale-vectors", type=int, default=1_000_000)
    p.add_argument("--scale-queries", type=int, default=200)
    p.add_argument("--skip-shards", action="store_true")


def run(args) -> None:
    if args.vectors:
        bench_faiss(args.vectors, args.queries)
    if args.scale_vectors:
        bench_scale(args.scale_vectors, args.scale_queries, not args.skip_shards)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args())

"""Retrieval benchmark: embedding throughput vs sentence-transformers, retrieval quality on
Python's pydoc topics, and FAISS recall@10 / QPS per index type at 100k+ vectors.

    python benchmarks/retrieval.py [--texts 512] [--vectors 100000] [--queries 1000]
                                   [--skip-embed] [--skip-quality] [--skip-faiss]

Embedding: the same texts (chunks of pydoc topics, as indexing sees them) through jaxserve's Flax
encoder and, when the `bench` extra is installed, sentence-transformers (PyTorch) on the same
weights in the same run; best of 3 after a warm-up pass (compiles every bucket used).
Quality: every pydoc topic in full, one document each, against benchmarks/data/pydoc_queries.json.
FAISS: synthetic clustered unit vectors (d=384, 200 overlapping Gaussian clusters; uniformly
random vectors have no neighbourhood structure and say nothing about real embeddings); ground truth
by exact search; queries are fresh draws from the same clusters. Rows print as markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pydoc_data.topics  # noqa: E402

from jaxserve.rag.chunking import chunk_document  # noqa: E402
from jaxserve.rag.config import IndexConfig, RagConfig  # noqa: E402
from jaxserve.rag.documents import Document  # noqa: E402
from jaxserve.rag.embedder import Embedder  # noqa: E402
from jaxserve.rag.evaluation import LabelledQuery, evaluate  # noqa: E402
from jaxserve.rag.service import RagService  # noqa: E402
from jaxserve.rag.vector_index import VectorIndex  # noqa: E402

QUERIES = Path(__file__).resolve().parent / "data" / "pydoc_queries.json"


def _best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _texts(embedder: Embedder, n: int) -> list[str]:
    config = RagConfig("/unused").chunker
    chunks = [c.text for topic, text in sorted(pydoc_data.topics.topics.items())
              for c in chunk_document(topic, text, embedder.token_spans, config)]
    return chunks[:n]


def _sentence_transformers(model_dir: Path):
    try:
        from sentence_transformers import SentenceTransformer, models
    except ImportError:
        return None
    # The cached directory holds the HF model only: rebuild all-MiniLM-L6-v2's pipeline.
    modules = [models.Transformer(str(model_dir), max_seq_length=256),
               models.Pooling(384, pooling_mode="mean"), models.Normalize()]
    return SentenceTransformer(modules=modules, device="cpu")


def bench_embedding(n: int) -> None:
    from jaxserve.model_registry import fetch

    embedder = Embedder.load()
    texts = _texts(embedder, n)
    tokens = sum(len(i) for i in embedder.tokenize(texts))
    print(f"\n### Embedding throughput ({len(texts)} pydoc chunks, {tokens} tokens, "
          f"mean {tokens / len(texts):.0f})\n")
    print("| implementation | batch | sentences/s | tokens/s | ratio |")
    print("|---|---|---|---|---|")
    ours, _ = embedder.embed(texts)  # compiles the buckets these texts use
    jax_s = _best_of(lambda: embedder.embed(texts))
    print(f"| jaxserve Flax BERT (JAX {__import__('jax').__version__}) | "
          f"{embedder.embedder_config.max_batch} | {len(texts) / jax_s:.1f} | "
          f"{tokens / jax_s:.0f} | 1.00 |")
    st = _sentence_transformers(fetch("all-minilm-l6-v2", quiet=True).parent)
    if st is None:
        print("\nsentence-transformers is not installed (pip install -e '.[bench]'): no baseline")
        return
    import torch

    for batch in (16, 32):
        theirs = st.encode(texts, batch_size=batch, convert_to_numpy=True)
        st_s = _best_of(lambda: st.encode(texts, batch_size=batch, convert_to_numpy=True))
        print(f"| sentence-transformers (torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads) | {batch} | {len(texts) / st_s:.1f} | {tokens / st_s:.0f} | "
              f"{jax_s / st_s:.2f} |")
    cosine = (ours * theirs).sum(1)
    print(f"\nagreement: min cosine {cosine.min():.6f} over {len(texts)} texts; ratio = "
          f"jaxserve time / baseline time (< 1: jaxserve faster)")


def bench_quality() -> None:
    queries = [LabelledQuery(q["query"], frozenset(q["relevant"]))
               for q in json.loads(QUERIES.read_text())["queries"]]
    with tempfile.TemporaryDirectory() as tmp:
        service = RagService(RagConfig(tmp))
        service.create_collection("pydoc")
        t0 = time.perf_counter()
        chunks = service.upsert("pydoc", [Document(topic, text) for topic, text
                                          in pydoc_data.topics.topics.items()])
        index_s = time.perf_counter() - t0
        print(f"\n### Quality: pydoc topics in full ({len(pydoc_data.topics.topics)} documents, "
              f"{chunks} chunks, indexed in {index_s:.1f} s), {len(queries)} labelled queries\n")
        print("| mode | recall@5 | top-1 |")
        print("|---|---|---|")
        for q in evaluate(service, "pydoc", queries, k=5):
            print(f"| {q.mode} | {q.recall_at_k:.3f} | {q.top1:.3f} |")
        service.close()


def _clustered(n: int, dim: int, centers: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Noise as large as the centres (norm ~1 each): clusters overlap, as topics do in real
    # embeddings, so the nearest neighbours are not simply "the rest of my cluster".
    x = centers[rng.integers(0, len(centers), n)] + rng.normal(0, 1 / dim ** 0.5, (n, dim))
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth)]))


def _qps(index: VectorIndex, queries: np.ndarray, k: int) -> tuple[np.ndarray, float, float]:
    """(ids, QPS with all queries in one call, QPS one query per call on one thread)."""
    import faiss

    batch_s = _best_of(lambda: index.search(queries, k))
    _, ids = index.search(queries, k)
    one = queries[:200]
    # One query has little to split across threads, and OpenMP's barriers cost ~10x on a loaded
    # machine: a server answering single queries runs them on one thread each.
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    single_s = _best_of(lambda: [index.search(q[None], k) for q in one])
    faiss.omp_set_num_threads(threads)
    return ids, len(queries) / batch_s, len(one) / single_s


def bench_faiss(n: int, num_queries: int, dim: int = 384, k: int = 10) -> None:
    import faiss

    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1 / dim ** 0.5, (200, dim))
    vectors = _clustered(n, dim, centers, rng)
    queries = _clustered(num_queries, dim, centers, rng)
    ids = np.arange(n, dtype=np.int64)
    print(f"\n### FAISS: {n} clustered vectors, d={dim}, {num_queries} queries, recall@{k} vs "
          f"exact, {faiss.omp_get_max_threads()} OpenMP threads\n")
    print("| index | build s | recall@10 | QPS (batch of all queries) "
          "| QPS (1 query/call, 1 thread) |")
    print("|---|---|---|---|---|")
    exact = VectorIndex(dim, IndexConfig(exact_max_vectors=n))
    t0 = time.perf_counter()
    exact.rebuild(ids, vectors)
    build = time.perf_counter() - t0
    assert exact.kind == "exact"
    truth, batch_qps, single_qps = _qps(exact, queries, k)
    print(f"| exact (IndexIDMap2 + IndexFlatIP) | {build:.2f} | 1.000 | {batch_qps:.0f} | "
          f"{single_qps:.0f} |")
    config = IndexConfig(exact_max_vectors=1)
    hnsw = VectorIndex(dim, config)
    t0 = time.perf_counter()
    hnsw.rebuild(ids, vectors)
    build = time.perf_counter() - t0
    assert hnsw.kind == "hnsw"
    for ef in (16, 32, 64, 128, 256):
        hnsw.config = dataclasses.replace(config, hnsw_ef_search=ef)
        found, batch_qps, single_qps = _qps(hnsw, queries, k)
        print(f"| HNSW M={config.hnsw_m} efConstruction={config.hnsw_ef_construction} "
              f"efSearch={ef} | {build:.1f} | {_recall(found, truth):.3f} | {batch_qps:.0f} | "
              f"{single_qps:.0f} |")
    # 10% deleted: tombstones filtered by an IDSelector during the graph search.
    hnsw.config = config
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


def add_arguments(p) -> None:
    p.add_argument("--vectors", type=int, default=100_000)
    p.add_argument("--queries", type=int, default=1000)


def run(args) -> None:
    bench_faiss(args.vectors, args.queries)

"""Retrieval benchmark: embedding throughput vs sentence-transformers, retrieval quality against a
naive baseline on two labelled corpora, and the index benchmarks of benchmarks/retrieval_index.py.

    python benchmarks/retrieval.py [--texts 512] [--sweep] [--sweep-chunking] [--llm-rerank N]
                                   [--data-dir DIR] [--skip-embed]
                                   [--skip-quality] [--skip-index] [index flags]

Embedding: the same texts (chunks of pydoc topics, as indexing makes them) through jaxserve's Flax
encoder and, when the `bench` extra is installed, sentence-transformers (PyTorch) on the same
weights in the same run; best of 3 after a warm-up pass (compiles every bucket used).

Quality, on Python's pydoc topics (benchmarks/data/pydoc_queries.json) and NumPy's docstrings
(benchmarks/data/numpy_queries.json), whole documents, recall@5 and top-1 by document:
- the naive baseline: the same MiniLM, fixed 200-word chunks, dense and BM25 (bm25s) top 20
  chunks each, reciprocal-rank fusion (k=60) of the chunk lists, top 5 chunks;
- jaxserve's collections in their default configuration, every mode, with and without rerank;
- `--sweep`: the search settings the defaults were chosen by (length penalties, the openings
  ranking, aggregation, fusion weights, rerank depth); `--sweep-chunking`: chunk size, overlap
  and boundaries (re-embeds both corpora per setting), and why chunk-level fusion lost to dense;
- `--llm-rerank N`: the served LLM (SmolLM2-135M) as a pointwise reranker of the top N documents
  ("Yes" vs "No" logprob), through the offline LLM API, for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bm25s  # noqa: E402
import faiss  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.rag.bm25 import BM25Index  # noqa: E402
from jaxserve.rag.chunking import chunk_document  # noqa: E402
from jaxserve.rag.config import ChunkerConfig, RagConfig, SearchConfig  # noqa: E402
from jaxserve.rag.documents import Document  # noqa: E402
from jaxserve.rag.embedder import Embedder  # noqa: E402
from jaxserve.rag.evaluation import CORPORA, Quality, evaluate, load_queries  # noqa: E402
from jaxserve.rag.fusion import reciprocal_rank_fusion  # noqa: E402
from jaxserve.rag.service import RagService  # noqa: E402
from benchmarks import provenance  # noqa: E402
from benchmarks.retrieval_index import best_of  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
K = 5


def _texts(embedder: Embedder, n: int) -> list[str]:
    config = RagConfig("/unused").chunker
    chunks = [c.text for doc in CORPORA["pydoc"]()
              for c in chunk_document(doc.id, doc.text, embedder.token_spans, config)]
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


def bench_embedding(embedder: Embedder, n: int) -> None:
    from jaxserve.model_registry import fetch

    texts = _texts(embedder, n)
    tokens = sum(len(i) for i in embedder.tokenize(texts))
    print(f"\n### Embedding throughput ({len(texts)} pydoc chunks, {tokens} tokens, "
          f"mean {tokens / len(texts):.0f})\n")
    print("| implementation | batch | sentences/s | tokens/s | ratio |")
    print("|---|---|---|---|---|")
    ours, _ = embedder.embed(texts)  # compiles the buckets these texts use
    jax_s = best_of(lambda: embedder.embed(texts))
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
        st_s = best_of(lambda: st.encode(texts, batch_size=batch, convert_to_numpy=True))
        print(f"| sentence-transformers (torch {torch.__version__}, {torch.get_num_threads()} "
              f"threads) | {batch} | {len(texts) / st_s:.1f} | {tokens / st_s:.0f} | "
              f"{jax_s / st_s:.2f} |")
    cosine = (ours * theirs).sum(1)
    print(f"\nagreement: min cosine {cosine.min():.6f} over {len(texts)} texts; ratio = "
          f"jaxserve time / baseline time (< 1: jaxserve faster)")


class ChunkLevelPipeline:
    """The naive pipeline: chunks, one dense and one BM25 ranking of chunks, RRF over the chunk
    lists, the top chunks as they come (no document grouping). With 200-word chunks it is the
    baseline; with jaxserve's former chunks (120-token windows) it is the former hybrid mode."""

    def __init__(self, embedder: Embedder, chunks: list[tuple[str, str]], depth_per_result=4,
                 vectors: np.ndarray | None = None):
        self.embedder, self.depth_per_result = embedder, depth_per_result
        self.documents = [d for d, _ in chunks]
        if vectors is None:
            vectors, _ = embedder.embed([t for _, t in chunks])
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize([t for _, t in chunks], stopwords="en",
                                       show_progress=False), show_progress=False)

    @classmethod
    def words(cls, embedder: Embedder, documents: list[Document], words: int = 200):
        chunks = []
        for doc in documents:
            w = doc.text.split()
            chunks += [(doc.id, " ".join(w[i:i + words])) for i in range(0, len(w), words)]
        return cls(embedder, chunks)

    def rankings(self, query: str, k: int) -> tuple[list[int], list[int]]:
        depth = k * self.depth_per_result
        _, dense = self.index.search(self.embedder.embed([query])[0], depth)
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        rows, scores = self.bm25.retrieve(tokens, k=depth, show_progress=False, n_threads=1)
        return dense[0].tolist(), [int(r) for r, s in zip(rows[0], scores[0]) if s > 0]

    def search(self, query: str, k: int, mode: str = "hybrid") -> list[str]:
        dense, lexical = self.rankings(query, k)
        ranked = {"dense": dense, "bm25": lexical,
                  "hybrid": [i for i, _ in reciprocal_rank_fusion([dense, lexical])]}[mode]
        return [self.documents[i] for i in ranked[:k]]

    def why_hybrid_lost(self, queries) -> str:
        """Where chunk-level fusion goes wrong: result slots spent on an already listed document,
        and, on the queries exactly one retriever gets right at top-1, how often fusion does and
        how long (in chunks) the documents it wrongly puts first are."""
        length = {d: self.documents.count(d) for d in set(self.documents)}
        repeats, split, fused_right, wrong, right = [], 0, 0, [], []
        for q in queries:
            dense, lexical = self.rankings(q.query, K)
            fused = [i for i, _ in reciprocal_rank_fusion([dense, lexical])]
            top5 = [self.documents[i] for i in fused[:K]]
            repeats.append(len(top5) - len(set(top5)))
            hits = [bool(r) and self.documents[r[0]] in q.relevant for r in (dense, lexical)]
            if hits[0] != hits[1]:
                split += 1
                fused_right += top5[0] in q.relevant
            if top5 and top5[0] not in q.relevant:
                wrong.append(length[top5[0]])
                right.append(min(length.get(d, 0) for d in q.relevant))
        return (f"{np.mean(repeats):.1f} of {K} slots repeat a listed document; "
                f"{fused_right} of {split} split queries fused right; wrong first documents: "
                f"median {np.median(wrong) if wrong else 0:.0f} chunks, the right ones "
                f"{np.median(right) if right else 0:.0f}")


def _row(name: str, qualities: dict[str, Quality], extra: str = "") -> None:
    cells = " | ".join(f"{q.recall_at_k:.3f} | {q.top1:.3f}" for q in qualities.values())
    print(f"| {name} | {cells} |{extra}")


def _header(first: str, corpora, extra: str = "") -> None:
    cols = " | ".join(f"{c} recall@{K} | {c} top-1" for c in corpora)
    print(f"\n| {first} | {cols} |{extra}")
    print("|---" * (1 + 2 * len(corpora) + extra.count("|")) + "|")


class Corpora:
    """Every labelled corpus indexed by one RagService (one collection each). A collection
    already under `directory` (a `--data-dir` of an earlier run, same chunker) is searched as it
    is, not re-embedded; index_s is then the time to open it."""

    def __init__(self, embedder: Embedder, chunker: ChunkerConfig, directory: Path):
        self.service = RagService(RagConfig(directory, chunker=chunker), embedder)
        self.documents = {name: load() for name, load in CORPORA.items()}
        self.queries = {name: load_queries(DATA / f"{name}_queries.json") for name in CORPORA}
        self.chunks, t0 = {}, time.perf_counter()
        existing = self.service.list_collections()
        for name, documents in self.documents.items():
            if name in existing:
                self.chunks[name] = self.service.collection(name).info()["chunks"]
                continue
            self.service.create_collection(name)
            self.chunks[name] = self.service.upsert(name, documents)[0]
        self.index_s = time.perf_counter() - t0

    def quality(self, mode: str = "hybrid", rerank: bool = False,
                search: SearchConfig | None = None) -> tuple[dict[str, Quality], float]:
        """Per corpus quality, and the mean search latency in ms."""
        out, calls, t0 = {}, 0, time.perf_counter()
        for name, queries in self.queries.items():
            collection = self.service.collection(name)
            if search is not None:
                collection.config = dataclasses.replace(collection.config, search=search)

            def run(query: str, k: int) -> list[str]:
                return [r.document_id for r in collection.search(query, k, mode, rerank)]

            out[name] = evaluate(run, queries, K)
            calls += len(queries)
            collection.config = self.service.config
        return out, 1000 * (time.perf_counter() - t0) / calls

    def former_pipeline(self, name: str) -> ChunkLevelPipeline:
        """The chunk-level pipeline over this collection's stored chunks and vectors."""
        store = self.service.collection(name)._store  # a benchmark may read the store directly
        ids, documents, vectors = store.all_vectors(self.service.embedder.dim)
        texts = dict(zip(*store.all_texts()))
        return ChunkLevelPipeline(self.service.embedder,
                                  [(d, texts[i]) for i, d in zip(ids.tolist(), documents)],
                                  vectors=vectors)

    def close(self) -> None:
        self.service.close()


def _corpora_dir(data_dir: Path | None, chunker: ChunkerConfig):
    """Where a run indexes the corpora: a temporary directory, or with --data-dir one kept per
    chunker setting (embedding both corpora is most of a quality run on this CPU)."""
    if data_dir is None:
        return tempfile.TemporaryDirectory()
    path = data_dir / f"{chunker.boundaries}-{chunker.chunk_tokens}-{chunker.overlap_tokens}"
    path.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(path))


def bench_quality(embedder: Embedder, sweep: bool, sweep_chunks: bool, llm_rerank: int,
                  data_dir: Path | None = None) -> None:
    names = list(CORPORA)
    counts = {n: len(load_queries(DATA / f"{n}_queries.json")) for n in names}
    print(f"\n### Retrieval quality: {', '.join(f'{n} ({counts[n]} queries)' for n in names)}; "
          f"recall@{K} and top-1 by document; latency = mean per search, this run")
    docs = {n: load() for n, load in CORPORA.items()}
    baselines = {n: ChunkLevelPipeline.words(embedder, docs[n]) for n in names}
    queries = {n: load_queries(DATA / f"{n}_queries.json") for n in names}
    _header("pipeline", names, " ms/search |")
    for mode in ("dense", "bm25", "hybrid"):
        t0 = time.perf_counter()
        quality = {n: evaluate(lambda q, k: baselines[n].search(q, k, mode), queries[n], K)
                   for n in names}
        ms = 1000 * (time.perf_counter() - t0) / sum(counts.values())
        _row(f"naive baseline (200-word chunks, chunk RRF), {mode}", quality, f" {ms:.0f} |")
    with _corpora_dir(data_dir, ChunkerConfig()) as tmp:
        corpora = Corpora(embedder, ChunkerConfig(), Path(tmp))
        for mode, rerank in (("dense", False), ("bm25", False), ("hybrid", False),
                             ("hybrid", True)):
            quality, ms = corpora.quality(mode, rerank)
            _row(f"jaxserve {mode}{' + rerank' if rerank else ''}"
                 f"{' (default)' if mode == 'hybrid' and not rerank else ''}", quality,
                 f" {ms:.0f} |")
        print(f"\njaxserve chunks: {corpora.chunks} (indexed in {corpora.index_s:.0f} s); "
              f"baseline chunks: { {n: len(b.documents) for n, b in baselines.items()} }")
        print("\nWhy chunk-level hybrid lost: the same chunks and vectors as the jaxserve rows, "
              "ranked as chunks (former pipeline: RRF of the top 20 chunks of each retriever):")
        for n in names:
            former = corpora.former_pipeline(n)
            quality = {m: evaluate(lambda q, k: former.search(q, k, m), queries[n], K)
                       for m in ("dense", "bm25", "hybrid")}
            print(f"- {n}: " + ", ".join(f"{m} {q.recall_at_k:.3f} / {q.top1:.3f}"
                                         for m, q in quality.items())
                  + f"; {former.why_hybrid_lost(queries[n])}")
        if sweep:
            sweep_search(corpora)
        if llm_rerank:
            bench_llm_rerank(corpora, llm_rerank)
        corpora.close()
    if sweep_chunks:
        sweep_chunking(embedder, names, data_dir)


def sweep_search(corpora: Corpora) -> None:
    """Search-time settings on the default chunks: aggregation, fusion weights, rerank depth."""
    names = list(corpora.queries)
    _header("search setting (default chunks)", names, " ms/search |")
    # (row, mode, rerank, SearchConfig fields that differ from the defaults)
    variants = [("defaults", "hybrid", False, {}),
                ("no length penalties, no openings (grouping + RRF only)", "hybrid", False,
                 {"dense_length_penalty": 0, "opening_weight": 0}),
                ("no length penalty", "hybrid", False, {"dense_length_penalty": 0}),
                ("no openings ranking", "hybrid", False, {"opening_weight": 0})]
    variants += [(f"{field}={value}", "hybrid", False, {field: value}) for field, value in (
        ("opening_weight", 1), ("opening_weight", 3), ("dense_length_penalty", 0.01),
        ("dense_length_penalty", 0.03), ("bm25_length_penalty", 0.5), ("top_chunks", 2),
        ("bm25_weight", 0.25), ("bm25_weight", 1.0), ("dense_weight", 0.5), ("rrf_k", 10))]
    variants += [("dense, no length penalty", "dense", False, {"dense_length_penalty": 0}),
                 ("bm25, with bm25_length_penalty=0.5", "bm25", False,
                  {"bm25_length_penalty": 0.5})]
    # (20 is the default: the main table's rerank row)
    variants += [(f"rerank, rerank_candidates={n}", "hybrid", True, {"rerank_candidates": n})
                 for n in (5, 10)]
    for name, mode, rerank, fields in variants:
        quality, ms = corpora.quality(mode, rerank,
                                      dataclasses.replace(SearchConfig(), **fields))
        _row(name, quality, f" {ms:.0f} |")
    # BM25 over whole words, as before stemming: the collections' lexical indexes are rebuilt
    # (from their stores; nothing re-embedded) without it, then dropped (rebuilt stemmed).
    collections = [corpora.service.collection(n) for n in names]
    for c in collections:
        c._bm25 = BM25Index(*c._store.all_texts(), stemmer=None)
    for mode in ("hybrid", "bm25"):
        quality, ms = corpora.quality(mode)
        _row(f"{mode}, BM25 without stemming", quality, f" {ms:.0f} |")
    for c in collections:
        c._bm25 = None


def sweep_chunking(embedder: Embedder, names: list[str], data_dir: Path | None) -> None:
    """Chunk size, overlap and boundaries, with the default search (each re-embeds both
    corpora)."""
    _header("chunker (hybrid, document aggregation)", names, " chunks | index s |")
    for tokens, overlap, boundaries in ((120, 24, "window"), (120, 0, "window"),
                                        (120, 0, "structure"), (120, 24, "structure"),
                                        (64, 0, "structure"), (64, 16, "structure"),
                                        (250, 0, "structure")):
        chunker = ChunkerConfig(tokens, overlap, boundaries)
        with _corpora_dir(data_dir, chunker) as tmp:
            corpora = Corpora(embedder, chunker, Path(tmp))
            quality, _ = corpora.quality()
            _row(f"{boundaries} {tokens} tokens, overlap {overlap}", quality,
                 f" {sum(corpora.chunks.values())} | {corpora.index_s:.0f} |")
            corpora.close()


def bench_llm_rerank(corpora: Corpora, n: int) -> None:
    """SmolLM2 as a pointwise reranker: for each of the fused top n documents' best chunk, the
    logprob of "Yes" less that of "No" after a relevance question, batched through
    LLM.generate (default engine settings, prefix caching on); documents reordered by it. Its
    cost is reported beside the same searches without it, timed in this function."""
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM("smollm2-135m-instruct", warmup=False, progress=False)
    tokenizer = llm.get_tokenizer()
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    prompt_tokens = []

    def rerank(collection, query: str) -> list[str]:
        results = collection.search(query, n)
        # The question first: the n prompts of a query share the template and question as a
        # prefix, which the prefix cache computes once.
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Question: {query}\n\nPassage:\n{r.text}\n\n"
              "Does the passage answer the question? Answer Yes or No."}])} for r in results]
        prompt_tokens.append(sum(len(p["prompt_token_ids"]) for p in prompts))

        def yes_margin(out) -> float:
            # logprob(Yes) - logprob(No) among the top 20; absent means below them.
            top = dict(out.outputs[0].logprobs[0].top)
            return top.get(yes, -30.0) - top.get(no, -30.0)
        margins = [yes_margin(o) for o in llm.generate(prompts, params)]
        return [results[i].document_id for i in sorted(range(len(results)),
                                                        key=lambda i: -margins[i])]

    names = list(corpora.queries)
    collections = {name: corpora.service.collection(name) for name in names}
    # warmup=False compiles on first use: two queries per corpus first, untimed, compile the
    # prefill and decode shapes the timed ones use.
    for name in names:
        for q in corpora.queries[name][:2]:
            rerank(collections[name], q.query)
    setup_s, prompt_tokens[:] = time.perf_counter() - t0, []
    quality, costs = {}, {}
    for label, search in (("hybrid (same run, no rerank)",
                           lambda c, q: [r.document_id for r in c.search(q, K)]),
                          (f"hybrid + SmolLM2-135M rerank of top {n}", rerank)):
        t0, calls = time.perf_counter(), 0
        for name in names:
            quality[name] = evaluate(lambda q, k: search(collections[name], q)[:k],
                                     corpora.queries[name], K)
            calls += len(corpora.queries[name])
        costs[label] = (quality.copy(), 1000 * (time.perf_counter() - t0) / calls)
    _header("LLM pointwise rerank", names, " ms/search | time vs no rerank |")
    base_ms = next(iter(costs.values()))[1]
    for label, (q, ms) in costs.items():
        _row(label, q, f" {ms:.0f} | {ms / base_ms:.0f}x |")
    print(f"\nLLM load + compile (two queries per corpus, untimed above): {setup_s:.0f} s; "
          f"prompt tokens per reranked search: mean {np.mean(prompt_tokens):.0f}")


def main() -> None:
    from benchmarks import retrieval_index

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-chunking", action="store_true")
    p.add_argument("--llm-rerank", type=int, default=0, metavar="N")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep the indexed corpora here and reuse them in later runs")
    p.add_argument("--skip-embed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-index", action="store_true")
    retrieval_index.add_arguments(p)
    args = p.parse_args()
    import jax

    print(f"machine: {provenance.cpu()}, {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}), date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"commit {provenance.commit()}")
    if not (args.skip_embed and args.skip_quality):
        embedder = Embedder.load()
        if not args.skip_embed:
            bench_embedding(embedder, args.texts)
        if not args.skip_quality:
            bench_quality(embedder, args.sweep, args.sweep_chunking, args.llm_rerank,
                          args.data_dir)
    if not args.skip_index:
        retrieval_index.run(args)


if __name__ == "__main__":
    main()

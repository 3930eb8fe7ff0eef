"""Sentence embeddings with the Flax BERT encoder: tokenise, bucket, run, un-pad.

Texts are sorted by length and cut into batches of at most `max_batch`; each batch is padded to a
power-of-two number of rows and of tokens, so the jitted `bert.embed` compiles once per bucket and
short texts do not pay for long ones. Calls are thread-safe (the HTTP server runs them in an
executor) and block until the vectors are on the host.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

from jaxserve.errors import InvalidRequest, ModelNotFound
from jaxserve.executor.models import bert
from jaxserve.rag.config import EmbedderConfig


def _bucket(n: int, lo: int, hi: int) -> int:
    return min(max(lo, 1 << (n - 1).bit_length()), hi)


class Embedder:
    def __init__(self, config: bert.BertConfig, params: dict, tokenizer_path: Path,
                 embedder_config: EmbedderConfig = EmbedderConfig()):
        self.config = config
        self.embedder_config = embedder_config
        self.params = jax.device_put(params)
        self.dim = config.hidden_size
        self.max_length = min(embedder_config.max_length, config.max_position_embeddings)
        # Two instances: tokenizer.json turns on fixed padding/truncation that we do per bucket,
        # and the chunker needs whole documents with character offsets.
        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(self.max_length)
        self._spans = Tokenizer.from_file(str(tokenizer_path))
        self._spans.no_padding()
        self._spans.no_truncation()
        self._embed = jax.jit(bert.embed, static_argnums=1)
        self._token_vectors = jax.jit(bert.token_vectors, static_argnums=1)

    @classmethod
    def load(cls, embedder_config: EmbedderConfig = EmbedderConfig()) -> "Embedder":
        """The registered (fetched) model or the HF BERT directory `embedder_config.model`."""
        from jaxserve.model_registry import resolve
        from jaxserve.weights.bert import load_bert

        spec = resolve(embedder_config.model)
        directory = spec.path if spec.path.is_dir() else spec.path.parent
        if not (directory / "tokenizer.json").exists():
            raise ModelNotFound(f"{directory} has no tokenizer.json")
        config, params = load_bert(directory)
        return cls(config, params, directory / "tokenizer.json", embedder_config)

    @property
    def name(self) -> str:
        return self.embedder_config.model

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character span of every token of `text` (no special tokens, no truncation)."""
        return self._spans.encode(text, add_special_tokens=False).offsets

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Encoder input ids, [CLS] ... [SEP], truncated to max_length."""
        return [e.ids for e in self._tokenizer.encode_batch(texts)]

    def _buckets(self) -> list[tuple[int, int]]:
        cfg = self.embedder_config
        rows = [1 << i for i in range(cfg.max_batch.bit_length())]
        lengths = sorted({_bucket(n, cfg.min_length, self.max_length)
                          for n in (1 << i for i in range(self.max_length.bit_length() + 1))})
        return [(b, t) for b in rows for t in lengths]

    def warmup(self, token_vectors: bool = False) -> int:
        """Compile every bucket now so that serving never waits for XLA (with token_vectors, the
        late-interaction reranker's programs too); returns how many."""
        buckets = self._buckets()
        fns = (self._embed, self._token_vectors) if token_vectors else (self._embed,)
        for fn in fns:
            for rows, tokens in buckets:
                ids = np.zeros((rows, tokens), np.int32)
                jax.block_until_ready(fn(self.params, self.config, ids, ids))
        return len(buckets) * len(fns)

    def _batches(self, ids: list[list[int]]):
        """(row indices, input_ids, mask) per bucketed batch: sorted by length so short texts do
        not pay for long ones."""
        cfg = self.embedder_config
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), cfg.max_batch):
            rows = order[start:start + cfg.max_batch]
            length = _bucket(max(len(ids[i]) for i in rows), cfg.min_length, self.max_length)
            batch = _bucket(len(rows), 1, cfg.max_batch)
            input_ids = np.zeros((batch, length), np.int32)
            mask = np.zeros((batch, length), np.int32)
            for r, i in enumerate(rows):
                input_ids[r, :len(ids[i])] = ids[i]
                mask[r, :len(ids[i])] = 1
            yield rows, input_ids, mask

    def embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        """Embeddings [N, dim] float32 of tokenised texts, in input order."""
        out = np.zeros((len(ids), self.dim), np.float32)
        for rows, input_ids, mask in self._batches(ids):
            vectors = self._embed(self.params, self.config, input_ids, mask)
            out[rows] = np.asarray(vectors)[:len(rows)]
        return out

    def token_vectors(self, ids: list[list[int]]) -> list[np.ndarray]:
        """Per text, its tokens' L2-normalised vectors [len(ids[i]), dim], in input order."""
        out: list[np.ndarray] = [np.zeros((0, self.dim), np.float32)] * len(ids)
        for rows, input_ids, mask in self._batches(ids):
            vectors = np.asarray(self._token_vectors(self.params, self.config, input_ids, mask))
            for r, i in enumerate(rows):
                out[i] = vectors[r, :len(ids[i])]
        return out

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """(embeddings [N, dim] float32, number of tokens the encoder read)."""
        if not texts:
            return np.zeros((0, self.dim), np.float32), 0
        if any(not isinstance(t, str) or not t for t in texts):
            raise InvalidRequest("every text to embed must be a non-empty string", param="input")
        ids = self.tokenize(texts)
        return self.embed_ids(ids), sum(len(i) for i in ids)

"""Shared RAG test pieces: a tiny random BERT with the real all-MiniLM-L6-v2 tokenizer, and the
real model, each built once per test session."""

from __future__ import annotations

import functools

import jax

from jaxserve.executor.models.bert import BertConfig, init_params
from jaxserve.rag.config import EmbedderConfig
from jaxserve.rag.embedder import Embedder

MINILM = "all-minilm-l6-v2"
TINY = BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, max_position_embeddings=64)


@functools.cache
def minilm_dir():
    from jaxserve.model_registry import fetch

    return fetch(MINILM, quiet=True).parent


@functools.cache
def tiny_embedder() -> Embedder:
    """Random weights: fast to compile and run; its vectors still separate unrelated texts
    well enough for mechanics tests (persistence, deletion, routes), not for quality."""
    params = init_params(TINY, jax.random.PRNGKey(0))
    return Embedder(TINY, params, minilm_dir() / "tokenizer.json",
                    EmbedderConfig(max_batch=4, max_length=64))


@functools.cache
def minilm_embedder() -> Embedder:
    minilm_dir()
    return Embedder.load(EmbedderConfig())

"""Chunking: windows of tokens with overlap, mapped back to exact character spans."""

from __future__ import annotations

import re

import pytest

from jaxserve.errors import ConfigError
from jaxserve.rag.chunking import chunk_document
from jaxserve.rag.config import ChunkerConfig, RagConfig
from tests.rag_helpers import tiny_embedder


def _words(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def test_windows_overlap_and_cover_the_document():
    text = " ".join(f"w{i}" for i in range(23))
    chunks = chunk_document("d", text, _words, ChunkerConfig(chunk_tokens=10, overlap_tokens=3),
                            {"k": "v"})
    # Starts every 7 words: 0-9, 7-16, 14-22 (the last window reaches the end).
    assert [c.text.split()[0] for c in chunks] == ["w0", "w7", "w14"]
    assert [c.text.split()[-1] for c in chunks] == ["w9", "w16", "w22"]
    assert [c.index for c in chunks] == [0, 1, 2]
    for c in chunks:
        assert text[c.start:c.end] == c.text and c.document_id == "d" and c.metadata == {"k": "v"}


def test_short_and_empty_documents():
    config = ChunkerConfig(chunk_tokens=10, overlap_tokens=3)
    [only] = chunk_document("d", "  just three words ", _words, config)
    assert (only.start, only.end, only.text) == (2, 18, "just three words")
    assert chunk_document("d", " \n ", _words, config) == []


def test_real_tokenizer_offsets_are_character_offsets():
    text = "Crème brûlée — naïve café façade. " * 30
    embedder = tiny_embedder()
    chunks = chunk_document("d", text, embedder.token_spans, ChunkerConfig(40, 8))
    assert len(chunks) > 2
    for c in chunks:
        assert text[c.start:c.end] == c.text
        # [CLS] + [SEP] + at most the window: re-tokenising a chunk does not overflow it.
        assert len(embedder.tokenize([c.text])[0]) <= 42


def test_config_validation():
    with pytest.raises(ConfigError):
        ChunkerConfig(chunk_tokens=10, overlap_tokens=10)
    with pytest.raises(ConfigError):
        RagConfig("/tmp/x", chunker=ChunkerConfig(chunk_tokens=255))

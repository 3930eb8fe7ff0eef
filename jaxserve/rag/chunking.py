"""Token-aware chunking with overlap: windows of encoder tokens mapped back to character spans.

A chunk's text is the document's own characters from its first token's start to its last token's
end, so `text == document[start:end]` always holds and citations can point into the original.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from jaxserve.rag.config import ChunkerConfig

TokenSpans = Callable[[str], list[tuple[int, int]]]


@dataclass(frozen=True)
class Chunk:
    document_id: str
    index: int  # position within its document
    start: int  # character offsets into the document text
    end: int
    text: str
    metadata: dict = field(default_factory=dict)


def chunk_document(document_id: str, text: str, token_spans: TokenSpans, config: ChunkerConfig,
                   metadata: dict | None = None) -> list[Chunk]:
    """Windows of `config.chunk_tokens` tokens, each starting `chunk_tokens - overlap_tokens`
    tokens after the previous one; the last window ends at the document's last token."""
    spans = token_spans(text)
    metadata = dict(metadata or {})
    if not spans:
        return []
    stride = config.chunk_tokens - config.overlap_tokens
    chunks = []
    start = 0
    while True:
        window = spans[start:start + config.chunk_tokens]
        lo, hi = window[0][0], window[-1][1]
        chunks.append(Chunk(document_id, len(chunks), lo, hi, text[lo:hi], metadata))
        if start + config.chunk_tokens >= len(spans):
            return chunks
        start += stride

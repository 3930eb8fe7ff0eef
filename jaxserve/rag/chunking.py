"""Chunking, in encoder tokens, with character offsets into the document.

Two kinds of boundaries (`ChunkerConfig.boundaries`):
- "structure" (the default): the largest units that fit `chunk_tokens` — sections separated by
  runs of blank lines, then paragraphs, lines, Unicode sentences, words — merged greedily, as
  semantic-text-splitter (maintained; Rust) does it. A chunk rarely starts or ends mid-sentence,
  which is what the encoder's one vector per chunk has to summarise.
- "window": fixed windows of `chunk_tokens` tokens, each starting `chunk_tokens - overlap_tokens`
  tokens after the previous one.

Either way a chunk's text is the document's own characters, `text == document[start:end]`, so
citations can point into the original.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from semantic_text_splitter import TextSplitter

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
    metadata = dict(metadata or {})
    spans = (_structure_spans if config.boundaries == "structure" else _window_spans)(
        text, token_spans, config)
    return [Chunk(document_id, i, lo, hi, text[lo:hi], metadata)
            for i, (lo, hi) in enumerate(spans)]


def _window_spans(text: str, token_spans: TokenSpans,
                  config: ChunkerConfig) -> list[tuple[int, int]]:
    """The last window ends at the document's last token."""
    spans = token_spans(text)
    if not spans:
        return []
    stride = config.chunk_tokens - config.overlap_tokens
    out, start = [], 0
    while True:
        window = spans[start:start + config.chunk_tokens]
        out.append((window[0][0], window[-1][1]))
        if start + config.chunk_tokens >= len(spans):
            return out
        start += stride


def _structure_spans(text: str, token_spans: TokenSpans,
                     config: ChunkerConfig) -> list[tuple[int, int]]:
    # The splitter counts a candidate's tokens with our tokenizer (the callback), so a chunk
    # re-tokenised on its own never exceeds chunk_tokens; it returns character offsets.
    splitter = TextSplitter.from_callback(lambda piece: len(token_spans(piece)),
                                          config.chunk_tokens, config.overlap_tokens)
    return [(start, start + len(piece)) for start, piece in splitter.chunk_indices(text)]

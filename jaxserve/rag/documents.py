"""Documents coming in: validated from JSON request bodies, or read from files (jaxserve index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxserve.errors import InvalidRequest

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: dict = field(default_factory=dict)


def parse_document(item: Any, where: str) -> Document:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object with 'id' and 'text'", param="documents")
    unknown = sorted(set(item) - {"id", "text", "metadata"})
    if unknown:
        raise InvalidRequest(f"{where} has an unknown field {unknown[0]!r}", param="documents")
    doc_id, text, metadata = item.get("id"), item.get("text"), item.get("metadata", {})
    if not isinstance(doc_id, str) or not doc_id:
        raise InvalidRequest(f"{where}.id must be a non-empty string", param="documents")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param="documents")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise InvalidRequest(f"{where}.metadata must be an object", param="documents")
    return Document(doc_id, text, metadata)


def parse_documents(items: Any) -> list[Document]:
    """A request's "documents" list; ids must be unique within it (an upsert of one id twice in
    the same request has no clear winner)."""
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'documents' must be a non-empty list", param="documents")
    docs = [parse_document(item, f"documents[{i}]") for i, item in enumerate(items)]
    seen = set()
    for doc in docs:
        if doc.id in seen:
            raise InvalidRequest(f"document id {doc.id!r} appears twice", param="documents")
        seen.add(doc.id)
    return docs


def _jsonl_documents(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"{path}:{number}: not JSON: {e}") from None
            doc = parse_document(item, f"{path}:{number}")
            yield Document(doc.id, doc.text, {"source": str(path), **doc.metadata})


def read_documents(paths: list[Path]) -> Iterator[Document]:
    """Text/markdown files become one document each, id = the path as given; a .jsonl file holds
    one {"id", "text", "metadata"?} object per line. Directories are walked."""
    for path in paths:
        if path.is_dir():
            yield from read_documents(sorted(p for p in path.rglob("*") if p.is_file()
                                             and p.suffix in TEXT_SUFFIXES + (".jsonl",)))
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path)
        elif path.suffix in TEXT_SUFFIXES:
            yield Document(str(path), path.read_text(encoding="utf-8"), {"source": str(path)})
        elif not path.exists():
            raise InvalidRequest(f"{path}: no such file or directory")
        else:
            raise InvalidRequest(f"{path}: unsupported file type (expected "
                                 f"{', '.join(TEXT_SUFFIXES)} or .jsonl)")

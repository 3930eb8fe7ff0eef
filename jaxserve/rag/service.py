"""RagService: the named collections under one data directory, and the embedder they share.

The front ends (HTTP routes, gRPC Embed, the CLI) and the chat `rag` option all go through this.
Its methods block (embedding, SQLite, FAISS): async callers run them in an executor. Constructing
it is cheap; the encoder loads on first use or at `warmup()`.

A collection belongs to the tenant that created it (its name in the file `owner` of the
collection's directory; a collection without one, made before owners were kept, is the open
server's tenant `default`'s). A method given `tenant` acts only on that tenant's collections:
another's is NotFound, word for word as a missing one, so its existence is not revealed.
`tenant=None` (the CLI, the Python API, the admin key's routes) sees every collection.
"""

from __future__ import annotations

import re
import shutil
import threading

import numpy as np

from jaxserve.errors import AlreadyExists, InvalidRequest, ModelNotFound, NotFound
from jaxserve.rag.collection import Collection, SearchResult
from jaxserve.rag.config import RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.embedder import Embedder
from jaxserve.rag.rerank import LateInteractionReranker

_OWNER_FILE = "owner"
_LEGACY_OWNER = "default"
# Names become directory names: no separators, no dot-only names, bounded length.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_collection_name(name) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"collection name must be 1-64 letters, digits, '_', '.' or '-' "
                             f"starting with a letter or digit, got {name!r}", param="name")
    return name


class RagService:
    def __init__(self, config: RagConfig, embedder: Embedder | None = None):
        self.config = config
        self._embedder = embedder
        self._lock = threading.Lock()  # guards _embedder loading and the _open table
        self._open: dict[str, Collection] = {}
        self._root = config.data_dir / "collections"

    @property
    def embedder(self) -> Embedder:
        with self._lock:
            if self._embedder is None:
                self._embedder = Embedder.load(self.config.embedder)
            return self._embedder

    @property
    def model_name(self) -> str:
        return self.config.embedder.model

    def warmup(self) -> int:
        """Load the encoder and compile every bucket, the reranker's too; returns the number of
        programs."""
        return self.embedder.warmup(token_vectors=True)

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        return self.embedder.embed(texts)

    def check_model(self, model) -> None:
        if model != self.model_name:
            raise ModelNotFound(f"the embedding model is {self.model_name!r}, not {model!r}")

    def list_collections(self, tenant: str | None = None) -> list[str]:
        if not self._root.is_dir():
            return []
        return sorted(p.name for p in self._root.iterdir()
                      if p.is_dir() and _NAME.fullmatch(p.name)
                      and (tenant is None or self._owner(p) == tenant))

    def create_collection(self, name: str, tenant: str | None = None) -> Collection:
        check_collection_name(name)
        with self._lock:
            # Taken by another tenant: a 409 too (names are one namespace), naming no owner.
            if (self._root / name).exists():
                raise AlreadyExists(f"collection {name!r} exists already", param="name")
            (self._root / name).mkdir(parents=True)
            (self._root / name / _OWNER_FILE).write_text(tenant or _LEGACY_OWNER)
        return self.collection(name, tenant)

    def owner(self, name: str) -> str:
        """The tenant a collection belongs to (NotFound if it does not exist)."""
        with self._lock:
            return self._owner(self._directory(name, None))

    @staticmethod
    def _owner(directory) -> str:
        try:
            return (directory / _OWNER_FILE).read_text()
        except FileNotFoundError:
            return _LEGACY_OWNER

    def _directory(self, name: str, tenant: str | None):
        """The collection's directory (caller holds the lock), or NotFound: missing, or another
        tenant's."""
        check_collection_name(name)
        directory = self._root / name
        if not directory.is_dir() or (tenant is not None and self._owner(directory) != tenant):
            raise NotFound(f"collection {name!r} does not exist", param="collection")
        return directory

    def collection(self, name: str, tenant: str | None = None) -> Collection:
        """An existing collection (opened on first use), or NotFound."""
        embedder = self.embedder
        with self._lock:
            directory = self._directory(name, tenant)
            if name not in self._open:
                self._open[name] = Collection(name, directory, embedder, self.config,
                                              LateInteractionReranker(embedder))
            return self._open[name]

    def delete_collection(self, name: str, tenant: str | None = None) -> None:
        with self._lock:
            directory = self._directory(name, tenant)
            opened = self._open.pop(name, None)
            if opened is not None:
                opened.close(save=False)
            shutil.rmtree(directory)

    def upsert(self, name: str, documents: list[Document], tenant: str | None = None) -> int:
        return self.collection(name, tenant).upsert(documents)

    def delete_document(self, name: str, document_id: str, tenant: str | None = None) -> None:
        self.collection(name, tenant).delete(document_id)

    def search(self, name: str, query: str, top_k: int = 5, mode: str = "hybrid",
               rerank: bool = False, tenant: str | None = None) -> list[SearchResult]:
        return self.collection(name, tenant).search(query, top_k, mode, rerank)

    def rerank(self, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
        """(relevance score per document, tokens read): the reranker `search(rerank=True)` uses."""
        return LateInteractionReranker(self.embedder).score(query, documents)

    def close(self) -> None:
        with self._lock:
            for collection in self._open.values():
                collection.close()
            self._open.clear()

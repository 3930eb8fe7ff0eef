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

import contextlib
import os
import re
import shutil
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxserve.errors import AlreadyExists, InvalidRequest, ModelNotFound, NotFound, QuotaExceeded
from jaxserve.rag.collection import STORE_FILE, Collection, SearchResult
from jaxserve.rag.config import RagConfig
from jaxserve.rag.documents import Document
from jaxserve.rag.embedder import Embedder
from jaxserve.rag.rerank import LateInteractionReranker
from jaxserve.rag.store import count_documents

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
        self._lock = threading.Lock()  # guards _embedder loading and the open collections
        # The open collections, least recently used first, and how many calls use each: an idle
        # one is closed past config.max_open_collections (each holds file descriptors).
        self._open: OrderedDict[str, Collection] = OrderedDict()
        self._users: Counter[str] = Counter()
        self._root = config.data_dir / "collections"
        # Retrieval's own threads, for async callers (HTTP routes, gRPC Embed, chat `rag`): its
        # work never queues ahead of the loop's default executor's (grammar compiles).
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="rag")

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
            quota = self.config.quotas.max_collections
            if tenant is not None and len(self.list_collections(tenant)) >= quota:
                raise QuotaExceeded(f"this API key's tenant has {quota} collections, its quota: "
                                    f"delete one first", param="name")
            self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self._root / name).mkdir(mode=0o700)
            owner = os.open(self._root / name / _OWNER_FILE, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(owner, "w") as f:
                f.write(tenant or _LEGACY_OWNER)
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
        """An existing collection (opened on first use), or NotFound. It stays open while the
        open ones are few: a server calls the methods below, which keep it open while they run."""
        with self._using(name, tenant) as collection:
            return collection

    @contextlib.contextmanager
    def _using(self, name: str, tenant: str | None) -> Iterator[Collection]:
        """The collection, open and not closed until the block ends."""
        embedder = self.embedder
        with self._lock:
            directory = self._directory(name, tenant)
            if name not in self._open:
                for made in (self._root, directory):  # ones made before modes were kept too
                    os.chmod(made, 0o700)
                self._open[name] = Collection(name, directory, embedder, self.config,
                                              LateInteractionReranker(embedder))
            self._open.move_to_end(name)
            self._users[name] += 1
            collection = self._open[name]
        try:
            yield collection
        finally:
            with self._lock:
                self._users[name] -= 1
                if not self._users[name]:
                    del self._users[name]
                idle = [n for n in self._open if not self._users[n]]
                for n in idle[:max(0, len(self._open) - self.config.max_open_collections)]:
                    self._open.pop(n).close()

    def info(self, name: str, tenant: str | None = None) -> dict:
        with self._using(name, tenant) as collection:
            return collection.info()

    def collection_infos(self, tenant: str | None = None) -> list[dict]:
        """info() of every collection `tenant` may see, by name."""
        return [self.info(name, tenant) for name in self.list_collections(tenant)]

    def delete_collection(self, name: str, tenant: str | None = None) -> None:
        with self._lock:
            directory = self._directory(name, tenant)
            opened = self._open.pop(name, None)
            if opened is not None:
                opened.close(save=False)
            shutil.rmtree(directory)

    def upsert(self, name: str, documents: list[Document], tenant: str | None = None
               ) -> tuple[int, int]:
        """(chunks embedded, tokens the encoder read); a tenant's quotas are checked first."""
        with self._using(name, tenant) as collection:
            if tenant is not None:
                self._check_quotas(tenant, collection, documents)
            return collection.upsert(documents)

    def _check_quotas(self, tenant: str, collection: Collection,
                      documents: list[Document]) -> None:
        quotas = self.config.quotas
        names = self.list_collections(tenant)
        held = sum(self._documents(n) for n in names)
        adding = collection.new_documents([d.id for d in documents])
        if held + adding > quotas.max_documents:
            raise QuotaExceeded(f"this API key's tenant holds {held} documents; {adding} more "
                                f"would pass its quota of {quotas.max_documents}",
                                param="documents")
        used = sum(_disk_bytes(self._root / n) for n in names)
        adding = sum(len(d.text.encode()) for d in documents)
        if used + adding > quotas.max_bytes:
            raise QuotaExceeded(f"this API key's tenant's collections take {used} bytes; "
                                f"{adding} more would pass its quota of {quotas.max_bytes} bytes",
                                param="documents")

    def _documents(self, name: str) -> int:
        with self._lock:
            opened = name in self._open
        if opened:  # through it: SQLite keeps a second connection's descriptors while it is open
            with self._using(name, None) as collection:
                return collection.info()["documents"]
        return count_documents(self._root / name / STORE_FILE)

    def delete_document(self, name: str, document_id: str, tenant: str | None = None) -> None:
        with self._using(name, tenant) as collection:
            collection.delete(document_id)

    def search(self, name: str, query: str, top_k: int = 5, mode: str = "hybrid",
               rerank: bool = False, tenant: str | None = None) -> list[SearchResult]:
        with self._using(name, tenant) as collection:
            return collection.search(query, top_k, mode, rerank)

    def rerank(self, query: str, documents: list[str]) -> tuple[np.ndarray, int]:
        """(relevance score per document, tokens read): the reranker `search(rerank=True)` uses."""
        return LateInteractionReranker(self.embedder).score(query, documents)

    def close(self) -> None:
        self.executor.shutdown(cancel_futures=True)
        with self._lock:
            for collection in self._open.values():
                collection.close()
            self._open.clear()


def _disk_bytes(directory: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())

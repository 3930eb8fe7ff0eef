"""`jaxserve index`: files -> documents -> a collection, in batches, with a progress bar."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from jaxserve.errors import NotFound
from jaxserve.rag.documents import read_documents
from jaxserve.rag.service import RagService

# Documents per upsert: big enough for full encoder batches, small enough that an interrupted run
# keeps most of its work (each upsert commits and saves the index).
BATCH_DOCUMENTS = 64


def index_paths(service: RagService, name: str, paths: list[Path],
                progress: bool = True, tenant: str | None = None) -> tuple[int, int]:
    """Upsert every document found under `paths` into collection `name` (created if missing,
    belonging to `tenant`: None is the open server's `default`); returns (documents, chunks).
    With a tenant, another tenant's collection of that name is an error (AlreadyExists).
    Files are read and validated before anything is written."""
    documents = list(read_documents(paths))
    try:
        collection = service.collection(name, tenant)
    except NotFound:
        collection = service.create_collection(name, tenant)
    chunks = 0
    with tqdm(total=len(documents), unit="doc", disable=not progress, file=sys.stderr,
              desc=f"indexing into {name}") as bar:
        for start in range(0, len(documents), BATCH_DOCUMENTS):
            batch = documents[start:start + BATCH_DOCUMENTS]
            chunks += collection.upsert(batch)[0]
            bar.update(len(batch))
    return len(documents), chunks

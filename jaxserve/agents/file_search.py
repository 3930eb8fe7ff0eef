"""The `file_search` server tool: the model's query searched in the tenant's retrieval
collections (the tool's `vector_store_ids` name them; another tenant's is not found, as a
missing one), the best chunks returned as a `file_search_call` item's `results` (file_id: the
document id; filename: its metadata's `filename`, else the id) and read by the model as JSON.
Host side: no JAX (the RagService runs its encoder in its own executor)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from jaxserve.agents.tools import ToolContext, ToolError
from jaxserve.errors import JaxServeError

MAX_CITATIONS = 64  # file_citation annotations of one output text
DEFAULT_RESULTS = 10  # OpenAI's default max_num_results is 50; a small model's context is not
MAX_QUERY_CHARS = 200  # a search query, not a document (bounds the call's tokens too)


class FileSearch:
    kind = "file_search"
    item_type = "file_search_call"
    description = "Search the user's files for passages relevant to a query."
    parameters = {"type": "object", "properties": {"query": {
        "type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS}}, "required": ["query"],
        "additionalProperties": False}

    def __init__(self, rag):
        """`rag`: a jaxserve.rag.service.RagService."""
        self.rag = rag

    def for_tenant(self, tenant: str) -> FileSearch:
        return self

    async def execute(self, context: ToolContext, arguments: dict, config: dict) -> list[dict]:
        query = arguments.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("file_search needs a non-empty 'query'")
        top_k = config.get("max_num_results") or DEFAULT_RESULTS
        loop = asyncio.get_running_loop()
        hits = []
        for name in config["vector_store_ids"]:
            try:
                found = await loop.run_in_executor(self.rag.executor, lambda n=name: (
                    self.rag.search(n, query[:MAX_QUERY_CHARS], top_k, tenant=context.tenant)))
            except JaxServeError as e:  # a missing collection, a bad query: the model reads it
                raise ToolError(str(e)) from None
            hits += found
        hits.sort(key=lambda h: -h.score)
        return [{"file_id": h.document_id, "filename": str(h.metadata.get("filename",
                                                                          h.document_id)),
                 "score": float(h.score), "text": h.text,
                 "attributes": {k: v for k, v in h.metadata.items()
                                if isinstance(v, (str, float, bool, int))}}
                for h in hits[:top_k]]

    def item(self, item_id: str, arguments: dict, status: str, result: Any) -> dict:
        query = arguments.get("query")
        return {"type": self.item_type, "id": item_id, "status": status,
                "queries": [query] if isinstance(query, str) else [], "results": result}

    def arguments(self, item: dict) -> dict:
        return {"query": item["queries"][0]} if item.get("queries") else {}

    def model_text(self, item: dict) -> str:
        if item.get("status") != "completed":
            return "error: the search failed"
        return json.dumps([{"file_id": r["file_id"], "filename": r["filename"],
                            "text": r["text"]} for r in item["results"] or ()])


def searched_files(items: list[dict]) -> dict[str, str]:
    """file id -> filename of every file the completed file_search calls of `items` returned."""
    return {r["file_id"]: r["filename"] for item in items
            if item.get("type") == FileSearch.item_type and item.get("status") == "completed"
            for r in item.get("results") or ()}


def citations(text: str, files: dict[str, str]) -> list[dict]:
    """OpenAI's `file_citation` annotations of an answer: wherever the text names a file the
    search returned (its filename or its id, as a whole word), a citation of that file just
    after the name (`index`: where a client inserts its marker), in text order."""
    found = {}
    for file_id, filename in files.items():
        for name in {filename, file_id}:
            for match in re.finditer(rf"(?<!\w){re.escape(name)}(?!\w)", text):
                found.setdefault((match.end(), file_id), filename)
    return [{"type": "file_citation", "file_id": file_id, "filename": filename, "index": index}
            for (index, file_id), filename in sorted(found.items())[:MAX_CITATIONS]]

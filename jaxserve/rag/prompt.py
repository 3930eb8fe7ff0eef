"""Retrieval-augmented chat prompts: retrieved chunks go into the messages, delimited as untrusted
data, and the answer carries citations. Engine-independent: chat completions call
`augment_chat` (blocking: run it in an executor) before rendering the chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxserve.errors import InvalidRequest
from jaxserve.rag.collection import SearchResult, check_search_args
from jaxserve.rag.config import RagPromptConfig
from jaxserve.rag.service import RagService


@dataclass(frozen=True)
class RagRequest:
    """The `"rag": {"collection", "top_k"?, "mode"?, "rerank"?}` option of a chat completion."""

    collection: str
    top_k: int = 5
    mode: str = "hybrid"
    rerank: bool = False


def parse_rag_request(value: Any, max_top_k: int) -> RagRequest:
    if not isinstance(value, dict) or set(value) - {"collection", "top_k", "mode", "rerank"}:
        raise InvalidRequest("'rag' must be an object with 'collection' and optionally 'top_k', "
                             "'mode' and 'rerank'", param="rag")
    collection = value.get("collection")
    if not isinstance(collection, str) or not collection:
        raise InvalidRequest("'rag.collection' must be a collection name", param="rag")
    request = RagRequest(collection, value.get("top_k", 5), value.get("mode", "hybrid"),
                         value.get("rerank", False))
    # The query is checked later, once it is known (the last user message).
    check_search_args("-", request.top_k, request.mode, max_top_k, request.rerank)
    return request


def _text(content) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def retrieval_query(messages: Sequence[dict]) -> str:
    """What to search for: the last user message."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return _text(message.get("content"))
    raise InvalidRequest("a 'rag' request needs a user message to search for", param="messages")


def _quote(text: str, config: RagPromptConfig) -> str:
    # A document must not be able to close the untrusted block and speak as the system.
    for marker in (config.begin_marker, config.end_marker):
        text = text.replace(marker, "[marker removed]")
    return text


def _quote_id(text: str, config: RagPromptConfig) -> str:
    # An id is the client's text too (upsert): on one line, and without the markers.
    return _quote(" ".join(text.split()), config)


def build_rag_messages(messages: Sequence[dict], results: Sequence[SearchResult],
                       config: RagPromptConfig = RagPromptConfig()
                       ) -> tuple[list[dict], list[dict]]:
    """(messages with the context added, citations [{"document_id", "chunk_id", "score"}]).

    The context goes into the system message: appended to a leading one, else a new one placed
    first (many chat templates accept a system message only there). Input messages are not
    modified."""
    messages = [dict(m) for m in messages]
    if not results:
        return messages, []
    chunks = [config.chunk_template.format(n=n, document_id=_quote_id(r.document_id, config),
                                           chunk_id=_quote_id(r.chunk_id, config), score=r.score,
                                           text=_quote(r.text, config))
              for n, r in enumerate(results, start=1)]
    context = "\n".join([config.begin_marker, "\n\n".join(chunks), config.end_marker])
    instructions = config.instructions.format(context=context)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{_text(messages[0].get('content'))}\n\n{instructions}"
    else:
        messages.insert(0, {"role": "system", "content": instructions})
    citations = [{"document_id": r.document_id, "chunk_id": r.chunk_id, "score": r.score}
                 for r in results]
    return messages, citations


def augment_chat(service: RagService, messages: Sequence[dict], rag: RagRequest,
                 tenant: str | None = None,
                 screen: Callable[[list[SearchResult]], list[SearchResult]] | None = None
                 ) -> tuple[list[dict], list[dict]]:
    """Search `rag.collection` (one of `tenant`'s) for the last user message and build the
    augmented messages and citations with the service's prompt template (blocking; raises
    NotFound / InvalidRequest). `screen` (the content policy's input rules) may drop or redact
    results first."""
    results = service.search(rag.collection, retrieval_query(messages), rag.top_k, rag.mode,
                             rag.rerank, tenant)
    if screen is not None:
        results = screen(results)
    return build_rag_messages(messages, results, service.config.prompt)

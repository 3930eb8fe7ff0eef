"""HTTP routes of the retrieval pipeline: OpenAI embeddings, rerank (the Cohere/Jina shape vLLM
serves), and collections (documents, search).

`add_rag_routes(app, service)` registers them on the app built by `jaxserve.server.http.build_app`
(before the server starts), whose middleware maps typed errors to OpenAI error bodies: unknown
collection or document 404, existing collection 409, bad arguments 400. Every call into the
service (embedding, SQLite, FAISS) runs in the default executor so the event loop keeps serving
other requests, token streams included.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import uuid

from aiohttp import web

from jaxserve.errors import InvalidRequest, ModelNotFound
from jaxserve.rag.collection import check_search_args
from jaxserve.rag.documents import parse_documents
from jaxserve.rag.service import RagService, check_collection_name
from jaxserve.server.json_body import read_object

RAG_KEY = web.AppKey("rag", RagService)
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
MAX_RERANK_DOCUMENTS = 1000  # Cohere's recommended maximum per request
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
_RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "user"}


async def _call(request: web.Request, method: str, *args):
    service = request.app[RAG_KEY]
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(getattr(service, method), *args))


def _embedding_inputs(body: dict) -> list[str]:
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("'input' must be a string or a non-empty list of strings (token "
                             "arrays are not supported)", param="input")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(f"'input' takes at most {MAX_EMBEDDING_INPUTS} strings",
                             param="input")
    if any(not t for t in texts):
        raise InvalidRequest("'input' strings must not be empty", param="input")
    return texts


async def embeddings(request: web.Request) -> web.Response:
    service = request.app[RAG_KEY]
    body = await read_object(request, _EMBEDDING_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", param="model")
    service.check_model(model)
    texts = _embedding_inputs(body)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequest("'encoding_format' must be 'float' or 'base64'",
                             param="encoding_format")
    vectors, num_tokens = await _call(request, "embed", texts)
    dims = body.get("dimensions")
    if dims is not None and dims != vectors.shape[1]:
        raise InvalidRequest(f"'dimensions' must be {vectors.shape[1]} for {service.model_name} "
                             f"(it cannot shorten its embeddings)", param="dimensions")
    # base64 is what OpenAI's Python client asks for by default: little-endian float32 bytes.
    encode = ((lambda v: base64.b64encode(v.astype("<f4").tobytes()).decode())
              if encoding == "base64" else (lambda v: v.tolist()))
    return web.json_response({
        "object": "list", "model": service.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _rerank_documents(body: dict) -> list[str]:
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequest("'documents' must be a non-empty list of strings",
                             param="documents")
    if len(documents) > MAX_RERANK_DOCUMENTS:
        raise InvalidRequest(f"'documents' takes at most {MAX_RERANK_DOCUMENTS} strings",
                             param="documents")
    # Cohere and Jina also take {"text": ...} objects.
    texts = [d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d
             for d in documents]
    if not all(isinstance(t, str) and t for t in texts):
        raise InvalidRequest("'documents' must hold non-empty strings (or {\"text\": string} "
                             "objects)", param="documents")
    return texts


async def rerank(request: web.Request) -> web.Response:
    """POST /v1/rerank: {model?, query, documents, top_n?, return_documents?} -> {id, model,
    results: [{index, relevance_score, document: {text}}] best first, usage}. top_n 0 or absent:
    every document, as vLLM."""
    service = request.app[RAG_KEY]
    body = await read_object(request, _RERANK_FIELDS)
    model = body.get("model", service.model_name)
    if not isinstance(model, str) or model != service.model_name:
        raise ModelNotFound(f"the reranking model is {service.model_name!r}, not {model!r}")
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("'query' must be a non-empty string", param="query")
    documents = _rerank_documents(body)
    top_n = body.get("top_n")
    top_n = 0 if top_n is None else top_n
    if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= len(documents):
        raise InvalidRequest(f"'top_n' must be an integer in [1, {len(documents)}] (the number "
                             f"of documents), or 0 for all, got {top_n!r}", param="top_n")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise InvalidRequest("'return_documents' must be a boolean", param="return_documents")
    scores, num_tokens = await _call(request, "rerank", query, documents)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or len(documents)]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if return_documents else {})}
               for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": service.model_name,
                              "results": results, "usage": {"total_tokens": num_tokens}})


async def create_collection(request: web.Request) -> web.Response:
    body = await read_object(request, {"name"})
    collection = await _call(request, "create_collection", body.get("name"))
    return web.json_response(collection.info(), status=201)


async def list_collections(request: web.Request) -> web.Response:
    def infos(service: RagService) -> list[dict]:
        return [service.collection(name).info() for name in service.list_collections()]

    data = await asyncio.get_running_loop().run_in_executor(None, infos, request.app[RAG_KEY])
    return web.json_response({"object": "list", "data": data})


async def delete_collection(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    await _call(request, "delete_collection", name)
    return web.json_response({"name": name, "deleted": True})


async def upsert_documents(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    docs = parse_documents((await read_object(request, {"documents"})).get("documents"))
    chunks = await _call(request, "upsert", name, docs)
    return web.json_response({"collection": name, "documents": len(docs), "chunks": chunks})


async def delete_document(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    document_id = request.match_info["document_id"]
    await _call(request, "delete_document", name, document_id)
    return web.json_response({"id": document_id, "deleted": True})


async def search(request: web.Request) -> web.Response:
    service = request.app[RAG_KEY]
    name = check_collection_name(request.match_info["name"])
    body = await read_object(request, {"query", "top_k", "mode", "rerank"})
    query, top_k, mode = body.get("query"), body.get("top_k", 5), body.get("mode", "hybrid")
    rerank = body.get("rerank", False)
    check_search_args(query, top_k, mode, service.config.search.max_top_k, rerank)
    results = await _call(request, "search", name, query, top_k, mode, rerank)
    return web.json_response({"results": [r.to_dict() for r in results]})


def add_rag_routes(app: web.Application, service: RagService) -> None:
    """Serve embeddings and collections from `service`; call before the server starts."""
    app[RAG_KEY] = service
    app.add_routes([
        web.post("/v1/embeddings", embeddings),
        web.post("/v1/rerank", rerank),
        web.post("/v1/collections", create_collection),
        web.get("/v1/collections", list_collections),
        web.delete("/v1/collections/{name}", delete_collection),
        web.post("/v1/collections/{name}/documents", upsert_documents),
        web.delete("/v1/collections/{name}/documents/{document_id}", delete_document),
        web.post("/v1/collections/{name}/search", search),
    ])

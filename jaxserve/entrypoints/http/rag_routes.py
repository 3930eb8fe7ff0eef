"""HTTP routes of the retrieval pipeline: OpenAI embeddings, rerank (the Cohere/Jina shape vLLM
serves), and collections (documents, search).

`add_rag_routes(app, service)` registers them on the app built by
`jaxserve.entrypoints.http.app.build_app` (before the server starts), whose middleware maps typed
errors to OpenAI error bodies: unknown collection or document 404, existing collection 409, bad
arguments 400, a tenant's quota 429 `insufficient_quota`. Every call into the service (embedding,
SQLite, FAISS) runs on the service's own threads (RagService.executor), so the event loop keeps
serving other requests, token streams included.

Each tenant route is under its tenant's limits (`front_door.tenant_limited`): a request, a
concurrency slot while it runs, and for embeddings, rerank and upserts the tokens the encoder
read. A client that leaves while the service works keeps its slot until the work ends, and pays
its tokens (serving.offload).

Collections belong to the caller's tenant (RagService): another tenant's is a 404, as if it did
not exist, and `GET /v1/collections` lists only the caller's. The admin key (serve --admin-key)
lists, reads and searches every tenant's under /admin/v1/collections.
"""

from __future__ import annotations

import base64
import functools
import uuid
from typing import Callable

from aiohttp import web

from jaxserve.errors import InvalidRequest, ModelNotFound
from jaxserve.rag.collection import check_search_args
from jaxserve.rag.documents import parse_documents
from jaxserve.rag.service import RagService, check_collection_name
from jaxserve.entrypoints.serving import response_models as out
from jaxserve.entrypoints.http.admin_routes import admin_only
from jaxserve.entrypoints.http.front_door import caller, charge_tokens, lease_of, tenant_limited
from jaxserve.entrypoints.http.json_body import parse_body
from jaxserve.entrypoints.http.openapi import Route, add_routes
from jaxserve.entrypoints.serving.offload import encoder_tokens, no_tokens, run_held
from jaxserve.entrypoints.serving.request_models import (CreateCollectionRequest, EmbeddingRequest,
                                                         RerankRequest, SearchRequest,
                                                         UpsertDocumentsRequest, embedding_texts)

RAG_KEY = web.AppKey("rag", RagService)


async def _call(request: web.Request, method: str, *args, used_tokens=no_tokens, **kwargs):
    """The service's `method` on its threads, under the call's hold (admin calls have none)."""
    service = request.app[RAG_KEY]
    return await run_held(service.executor, lease_of(request), getattr(service, method), *args,
                          used_tokens=used_tokens, **kwargs)


def _tenant(request: web.Request) -> str:
    return caller(request).tenant.name


@tenant_limited(tokens=True)
async def embeddings(request: web.Request) -> web.Response:
    body = await parse_body(request, EmbeddingRequest)
    return web.json_response(await embeddings_response(
        request.app[RAG_KEY], body, lease_of(request), functools.partial(charge_tokens, request)))


async def embeddings_response(service: RagService, body: EmbeddingRequest, lease,
                              charge: Callable[[int], None]) -> dict:
    """The answer to an embeddings request (the route's, and a Batch API line's: entrypoints/
    batch_lines.py), read under `lease`; `charge(tokens read)` once the encoder has read them."""
    service.check_model(body.model)
    vectors, num_tokens = await run_held(service.executor, lease, service.embed,
                                         embedding_texts(body), used_tokens=encoder_tokens)
    charge(num_tokens)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise InvalidRequest(f"'dimensions' must be {vectors.shape[1]} for {service.model_name} "
                             f"(it cannot shorten its embeddings)", param="dimensions")
    # base64 is what OpenAI's Python client asks for by default: little-endian float32 bytes.
    encode = ((lambda v: base64.b64encode(v.astype("<f4").tobytes()).decode())
              if body.encoding_format == "base64" else (lambda v: v.tolist()))
    return {
        "object": "list", "model": service.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


@tenant_limited(tokens=True)
async def rerank(request: web.Request) -> web.Response:
    """POST /v1/rerank: {model?, query, documents, top_n?, return_documents?} -> {id, model,
    results: [{index, relevance_score, document: {text}}] best first, usage}. top_n 0 or absent:
    every document, as vLLM."""
    service = request.app[RAG_KEY]
    body = await parse_body(request, RerankRequest)
    if body.model is not None and body.model != service.model_name:
        raise ModelNotFound(f"the reranking model is {service.model_name!r}, not {body.model!r}")
    if not body.query.strip():
        raise InvalidRequest("'query' must be a non-empty string", param="query")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    top_n = body.top_n or 0
    if not 0 <= top_n <= len(documents):
        raise InvalidRequest(f"'top_n' must be an integer in [1, {len(documents)}] (the number "
                             f"of documents), or 0 for all, got {top_n!r}", param="top_n")
    scores, num_tokens = await _call(request, "rerank", body.query, documents,
                                     used_tokens=encoder_tokens)
    charge_tokens(request, num_tokens)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or len(documents)]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if body.return_documents is not False
                   else {})}
               for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": service.model_name,
                              "results": results, "usage": {"total_tokens": num_tokens}})


@tenant_limited()
async def create_collection(request: web.Request) -> web.Response:
    body = await parse_body(request, CreateCollectionRequest)
    collection = await _call(request, "create_collection", body.name, _tenant(request))
    return web.json_response(collection.info(), status=201)


@tenant_limited()
async def list_collections(request: web.Request) -> web.Response:
    data = await _call(request, "collection_infos", _tenant(request))
    return web.json_response({"object": "list", "data": data})


@tenant_limited()
async def delete_collection(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    await _call(request, "delete_collection", name, _tenant(request))
    return web.json_response({"name": name, "deleted": True})


@tenant_limited(tokens=True)
async def upsert_documents(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    body = await parse_body(request, UpsertDocumentsRequest)
    docs = parse_documents([d.model_dump(exclude_none=True) for d in body.documents])
    chunks, num_tokens = await _call(request, "upsert", name, docs, _tenant(request),
                                     used_tokens=encoder_tokens)
    charge_tokens(request, num_tokens)
    return web.json_response({"collection": name, "documents": len(docs), "chunks": chunks})


@tenant_limited()
async def delete_document(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    document_id = request.match_info["document_id"]
    await _call(request, "delete_document", name, document_id, _tenant(request))
    return web.json_response({"id": document_id, "deleted": True})


@tenant_limited()
async def search(request: web.Request) -> web.Response:
    return await _search(request, _tenant(request))


async def _search(request: web.Request, tenant: str | None) -> web.Response:
    service = request.app[RAG_KEY]
    name = check_collection_name(request.match_info["name"])
    body = await parse_body(request, SearchRequest)
    top_k = 5 if body.top_k is None else body.top_k
    mode, rerank = body.mode or "hybrid", bool(body.rerank)
    check_search_args(body.query, top_k, mode, service.config.search.max_top_k, rerank)
    results = await _call(request, "search", name, body.query, top_k, mode, rerank, tenant)
    return web.json_response({"results": [r.to_dict() for r in results]})


# ---- the admin key's view: every tenant's collections, each naming its owner


def _owned_info(service: RagService, name: str) -> dict:
    return {**service.info(name), "owner": service.owner(name)}


def _owned_infos(service: RagService) -> list[dict]:
    return [_owned_info(service, name) for name in service.list_collections()]


@admin_only
async def admin_list_collections(request: web.Request) -> web.Response:
    data = await run_held(request.app[RAG_KEY].executor, None, _owned_infos,
                          request.app[RAG_KEY])
    return web.json_response({"object": "list", "data": data})


@admin_only
async def admin_get_collection(request: web.Request) -> web.Response:
    name = check_collection_name(request.match_info["name"])
    return web.json_response(await run_held(request.app[RAG_KEY].executor, None, _owned_info,
                                            request.app[RAG_KEY], name))


@admin_only
async def admin_search(request: web.Request) -> web.Response:
    return await _search(request, None)


# A tenant route's errors beside its own: a bad body, a missing key, its tenant's limits, an
# audit log that cannot take its record (--audit-log).
_LIMITED = (400, 401, 429, 503)


def add_rag_routes(app: web.Application, service: RagService) -> None:
    """Serve embeddings and collections from `service`; call before the server starts."""
    app[RAG_KEY] = service
    tags = ("retrieval",)
    add_routes(app, [
        Route("POST", "/v1/embeddings", embeddings, "Embeddings (OpenAI)", EmbeddingRequest,
              out.Embeddings, errors=_LIMITED + (404,), tags=("openai",)),
        Route("POST", "/v1/rerank", rerank, "Rerank documents for a query (Cohere / Jina shape)",
              RerankRequest, out.Reranked, errors=_LIMITED + (404,), tags=tags),
        Route("POST", "/v1/collections", create_collection, "Create a collection",
              CreateCollectionRequest, out.CollectionInfo, ok_status=201,
              errors=_LIMITED + (409,),
              tags=tags),
        Route("GET", "/v1/collections", list_collections, "List collections",
              ok=out.CollectionList, errors=_LIMITED, tags=tags),
        Route("DELETE", "/v1/collections/{name}", delete_collection, "Delete a collection",
              ok=out.CollectionDeleted, errors=_LIMITED + (404,), tags=tags),
        Route("POST", "/v1/collections/{name}/documents", upsert_documents,
              "Add or replace documents (by id)", UpsertDocumentsRequest, out.DocumentsUpserted,
              errors=_LIMITED + (404,), tags=tags),
        Route("DELETE", "/v1/collections/{name}/documents/{document_id}", delete_document,
              "Delete a document", ok=out.DocumentDeleted, errors=_LIMITED + (404,), tags=tags),
        Route("POST", "/v1/collections/{name}/search", search, "Search a collection",
              SearchRequest, out.SearchResults, errors=_LIMITED + (404,), tags=tags),
        # The admin key's (401 without it, or with no --admin-key): every tenant's.
        Route("GET", "/admin/v1/collections", admin_list_collections,
              "Every tenant's collections, with their owner", errors=(401,), tags=("admin",)),
        Route("GET", "/admin/v1/collections/{name}", admin_get_collection,
              "Any tenant's collection, with its owner", errors=(400, 401, 404),
              tags=("admin",)),
        Route("POST", "/admin/v1/collections/{name}/search", admin_search,
              "Search any tenant's collection", SearchRequest, out.SearchResults,
              errors=(400, 401, 404), tags=("admin",)),
    ])

"""RAG routes end to end on a real aiohttp server (127.0.0.1, free port), plus gRPC Embed.

The encoder is the tiny random BERT: these tests are about the routes, statuses and bodies."""

from __future__ import annotations

import asyncio
import base64
import json

import grpc
import numpy as np
import openai
import pytest
from aiohttp import ClientSession

from jaxserve.config import ServerConfig
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from jaxserve.entrypoints.grpc import start_grpc_server
from jaxserve.entrypoints.http.app import build_app, start_server
from jaxserve.entrypoints.http.rag_routes import add_rag_routes
from tests.rag_helpers import MINILM, tiny_embedder

DOCS = [{"id": "fr", "text": "Paris is the capital of France.", "metadata": {"lang": "en"}},
        {"id": "de", "text": "Berlin is the capital of Germany."},
        {"id": "bake", "text": "Knead the dough and let the bread rise overnight."}]


@pytest.fixture
def service(tmp_path):
    config = RagConfig(tmp_path, EmbedderConfig(max_batch=4, max_length=64),
                       ChunkerConfig(chunk_tokens=48, overlap_tokens=8))
    service = RagService(config, tiny_embedder())
    yield service
    service.close()


def _serve(service, scenario, engine=None, model_name="some-llm", admin_key=None, **config):
    """Run `scenario(session, url)` against a started server, and always stop it. With an
    engine, generation is served too (chat completions with "rag" when there is a service);
    with `admin_key`, the admin API."""
    from jaxserve.entrypoints.http.admin_routes import add_admin_routes
    from jaxserve.entrypoints.http.app import attach_engine

    async def main():
        app = build_app(ServerConfig(port=0, **config), model_name)
        if service is not None:
            add_rag_routes(app, service)
        if admin_key is not None:
            add_admin_routes(app, None, admin_key)
        if engine is not None:
            attach_engine(app, engine, service)
        runner, port = await start_server(app, "127.0.0.1", 0)
        try:
            async with ClientSession() as session:
                return await scenario(session, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
    return asyncio.run(main())


async def _json(session, method, url, body=None):
    async with session.request(method, url, json=body) as resp:
        return resp.status, await resp.json()


def test_collection_lifecycle(service):
    async def scenario(s, url):
        assert await _json(s, "POST", f"{url}/v1/collections", {"name": "kb"}) == \
            (201, {"name": "kb", "documents": 0, "chunks": 0, "index": "exact"})
        status, body = await _json(s, "POST", f"{url}/v1/collections/kb/documents",
                                   {"documents": DOCS})
        assert (status, body) == (200, {"collection": "kb", "documents": 3, "chunks": 3})
        status, body = await _json(s, "GET", f"{url}/v1/collections")
        assert status == 200 and body["data"] == [
            {"name": "kb", "documents": 3, "chunks": 3, "index": "exact"}]

        status, body = await _json(s, "POST", f"{url}/v1/collections/kb/search",
                                   {"query": "capital of France", "top_k": 2, "mode": "bm25"})
        assert status == 200
        top = body["results"][0]
        assert {k: top[k] for k in ("document_id", "chunk_id", "text", "metadata")} == {
            "document_id": "fr", "chunk_id": "fr#0", "text": DOCS[0]["text"],
            "metadata": {"lang": "en"}}
        assert len(body["results"]) == 2 and top["score"] > body["results"][1]["score"]

        assert await _json(s, "DELETE", f"{url}/v1/collections/kb/documents/fr") == \
            (200, {"id": "fr", "deleted": True})
        for mode in ("dense", "bm25", "hybrid"):
            status, body = await _json(s, "POST", f"{url}/v1/collections/kb/search",
                                       {"query": "capital of France", "top_k": 10, "mode": mode})
            assert status == 200 and "fr" not in {r["document_id"] for r in body["results"]}
        assert await _json(s, "DELETE", f"{url}/v1/collections/kb") == \
            (200, {"name": "kb", "deleted": True})
        assert await _json(s, "GET", f"{url}/v1/collections") == (200, {"object": "list",
                                                                        "data": []})
    _serve(service, scenario)


def test_another_tenants_collection_is_a_404_as_if_missing(service, tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenant.alice]\napi_keys = ["sk-a"]\n[tenant.bob]\napi_keys = ["sk-b"]\n')

    async def call(s, method, url, key, body=None):
        async with s.request(method, url, json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()

    async def scenario(s, url):
        c = f"{url}/v1/collections"
        assert (await call(s, "POST", c, "sk-a", {"name": "kb"}))[0] == 201
        assert (await call(s, "POST", f"{c}/kb/documents", "sk-a", {"documents": DOCS}))[0] == 200
        search = {"query": "capital", "top_k": 1, "mode": "bm25"}
        missing = await call(s, "POST", f"{c}/nope/search", "sk-b", search)
        theirs = await call(s, "POST", f"{c}/kb/search", "sk-b", search)
        assert missing[0] == 404 and theirs == (404, {"error": {
            **missing[1]["error"], "message": missing[1]["error"]["message"].replace(
                "'nope'", "'kb'")}})
        for method, path, body in (("POST", "/kb/documents", {"documents": DOCS}),
                                   ("DELETE", "/kb/documents/fr", None), ("DELETE", "/kb", None)):
            assert (await call(s, method, f"{c}{path}", "sk-b", body))[0] == 404
        assert (await call(s, "GET", c, "sk-b"))[1]["data"] == []
        assert [d["name"] for d in (await call(s, "GET", c, "sk-a"))[1]["data"]] == ["kb"]
        assert (await call(s, "POST", f"{c}/kb/search", "sk-a", search))[0] == 200
    _serve(service, scenario, tenants_file=str(tenants))


def test_the_admin_key_sees_every_tenants_collections(service, tmp_path):
    """... those `jaxserve index --tenant` made offline too, which belong to that tenant."""
    from jaxserve.errors import AlreadyExists
    from jaxserve.rag.ingest import index_paths

    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenant.alice]\napi_keys = ["sk-a"]\n[tenant.bob]\napi_keys = ["sk-b"]\n')
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    assert index_paths(service, "offline", [docs], progress=False, tenant="bob") == (3, 3)

    async def call(s, method, url, key, body=None):
        async with s.request(method, url, json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()

    async def scenario(s, url):
        c, admin = f"{url}/v1/collections", f"{url}/admin/v1/collections"
        assert (await call(s, "POST", c, "sk-a", {"name": "kb"}))[0] == 201
        assert [d["name"] for d in (await call(s, "GET", c, "sk-b"))[1]["data"]] == ["offline"]
        assert [d["name"] for d in (await call(s, "GET", c, "sk-a"))[1]["data"]] == ["kb"]
        search = {"query": "capital", "top_k": 1, "mode": "bm25"}
        assert (await call(s, "POST", f"{c}/offline/search", "sk-a", search))[0] == 404
        assert (await call(s, "POST", f"{c}/offline/search", "sk-b", search))[0] == 200
        status, body = await call(s, "GET", admin, "root-key")
        assert status == 200 and body["data"] == [
            {"name": "kb", "documents": 0, "chunks": 0, "index": "exact", "owner": "alice"},
            {"name": "offline", "documents": 3, "chunks": 3, "index": "exact", "owner": "bob"}]
        assert (await call(s, "GET", f"{admin}/offline", "root-key"))[1]["owner"] == "bob"
        status, body = await call(s, "POST", f"{admin}/offline/search", "root-key", search)
        assert status == 200 and len(body["results"]) == 1
        assert (await call(s, "GET", f"{admin}/nope", "root-key"))[0] == 404
        for key in ("sk-a", "wrong"):  # a tenant's key is not the admin key
            assert (await call(s, "GET", admin, key))[0] == 401
    _serve(service, scenario, tenants_file=str(tenants), admin_key="root-key")
    with pytest.raises(AlreadyExists):  # a name another tenant holds
        index_paths(service, "offline", [docs], progress=False, tenant="alice")

    async def no_admin(s, url):  # no --admin-key: no admin
        return (await call(s, "GET", f"{url}/admin/v1/collections", "anything"))[0]
    assert _serve(service, no_admin) == 401


def test_errors_are_openai_error_bodies(service):
    async def scenario(s, url):
        await _json(s, "POST", f"{url}/v1/collections", {"name": "kb"})
        cases = [
            ("POST", "/v1/collections/nope/search", {"query": "q"}, 404, "collection"),
            ("DELETE", "/v1/collections/nope", None, 404, "collection"),
            ("POST", "/v1/collections/nope/documents", {"documents": DOCS}, 404, "collection"),
            ("DELETE", "/v1/collections/kb/documents/missing", None, 404, "document_id"),
            ("POST", "/v1/collections", {"name": "kb"}, 409, "name"),
            ("POST", "/v1/collections", {"name": "../etc"}, 400, "name"),
            ("POST", "/v1/collections/kb/search", {"query": ""}, 400, "query"),
            ("POST", "/v1/collections/kb/search", {"query": "q", "top_k": 0}, 400, "top_k"),
            ("POST", "/v1/collections/kb/search", {"query": "q", "top_k": "3"}, 400, "top_k"),
            ("POST", "/v1/collections/kb/search", {"query": "q", "mode": "x"}, 400, "mode"),
            ("POST", "/v1/collections/kb/search", {"query": "q", "k": 3}, 400, "k"),
            ("POST", "/v1/collections/kb/documents", {"documents": [{"id": "x"}]}, 400,
             "documents"),
            ("POST", "/v1/embeddings", {"model": "other", "input": "x"}, 404, "model"),
            ("POST", "/v1/embeddings", {"model": MINILM, "input": [1, 2]}, 400, "input"),
            ("POST", "/v1/embeddings", {"model": MINILM, "input": ""}, 400, "input"),
            ("POST", "/v1/embeddings", {"model": MINILM, "input": "x", "dimensions": 8}, 400,
             "dimensions"),
            ("POST", "/v1/collections/kb/search", {"query": "q", "rerank": "yes"}, 400, "rerank"),
            ("POST", "/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
            ("POST", "/v1/rerank", {"query": "q", "documents": ["a", ""]}, 400, "documents"),
            ("POST", "/v1/rerank", {"query": "q", "documents": "a"}, 400, "documents"),
            ("POST", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 2}, 400, "top_n"),
            ("POST", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n"),
            ("POST", "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, 400,
             "top_n"),
            ("POST", "/v1/rerank", {"model": "other", "query": "q", "documents": ["a"]}, 404,
             "model"),
            ("POST", "/v1/rerank", {"query": " ", "documents": ["a"]}, 400, "query"),
            ("POST", "/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": []}, 400,
             "rank_fields"),
        ]
        for method, path, body, status, param in cases:
            got_status, got = await _json(s, method, f"{url}{path}", body)
            assert (got_status, got["error"]["param"]) == (status, param), (path, body, got)
            assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"]
    _serve(service, scenario)


def test_rerank_shape_and_rerank_in_search(service):
    texts = [d["text"] for d in DOCS]
    query = "capital of France"

    async def scenario(s, url):
        top2 = await _json(s, "POST", f"{url}/v1/rerank",
                           {"model": MINILM, "query": query, "documents": texts, "top_n": 2})
        every = await _json(s, "POST", f"{url}/v1/rerank",
                            {"query": query, "documents": [{"text": t} for t in texts],
                             "top_n": 0, "return_documents": False})
        await _json(s, "POST", f"{url}/v1/collections", {"name": "kb"})
        await _json(s, "POST", f"{url}/v1/collections/kb/documents", {"documents": DOCS})
        searched = await _json(s, "POST", f"{url}/v1/collections/kb/search",
                               {"query": query, "top_k": 3, "rerank": True})
        return top2, every, searched

    (status, top2), (status_all, every), (status_search, searched) = _serve(service, scenario)
    scores, num_tokens = service.rerank(query, texts)
    order = np.argsort(-scores, kind="stable")
    assert status == status_all == status_search == 200
    assert top2["id"].startswith("rerank-") and top2["model"] == MINILM
    assert top2["usage"] == {"total_tokens": num_tokens}
    assert [r["index"] for r in top2["results"]] == order[:2].tolist()
    assert [r["relevance_score"] for r in top2["results"]] == pytest.approx(
        scores[order[:2]].tolist(), abs=1e-6)
    assert [r["document"] for r in top2["results"]] == [{"text": texts[i]} for i in order[:2]]
    assert [r["index"] for r in every["results"]] == order.tolist()
    assert all(set(r) == {"index", "relevance_score"} for r in every["results"])
    # search with rerank: the documents come back in the reranker's order, with its scores.
    results = searched["results"]
    assert [r["score"] for r in results] == pytest.approx(
        service.rerank(query, [r["text"] for r in results])[0].tolist(), abs=1e-6)
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)


def test_embeddings_with_the_openai_client(service):
    texts = ["The cat sits on the mat.", "Stock markets fell."]
    expected, num_tokens = service.embed(texts)

    async def scenario(s, url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        # The client asks for base64 by default and decodes it; ask for floats explicitly too.
        as_base64 = await client.embeddings.create(model=MINILM, input=texts)
        as_float = await client.embeddings.create(model=MINILM, input=texts[0],
                                                  encoding_format="float")
        await client.close()
        status, raw = await _json(s, "POST", f"{url}/v1/embeddings",
                                  {"model": MINILM, "input": texts, "encoding_format": "base64"})
        return as_base64, as_float, raw

    as_base64, as_float, raw = _serve(service, scenario)
    np.testing.assert_allclose([d.embedding for d in as_base64.data], expected, rtol=1e-6)
    np.testing.assert_allclose(as_float.data[0].embedding, expected[0], rtol=1e-6)
    assert as_base64.usage.prompt_tokens == as_base64.usage.total_tokens == num_tokens
    assert as_base64.model == MINILM and [d.index for d in as_base64.data] == [0, 1]
    decoded = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, expected[1])


def test_grpc_embed(service):
    async def main():
        server, port = await start_grpc_server(None, "127.0.0.1", 0, "some-llm", rag=service)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                reply = await stub.Embed(pb.EmbedRequest(model=MINILM, input=["a", "b c"]))
                errors = []
                for request in (pb.EmbedRequest(model="other", input=["a"]),
                                pb.EmbedRequest(model=MINILM)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Embed(request)
                    errors.append(e.value.code())
                return reply, errors
        finally:
            await server.stop(grace=None)

    reply, errors = asyncio.run(main())
    expected, _ = service.embed(["a", "b c"])
    np.testing.assert_allclose([e.values for e in reply.embeddings], expected, rtol=1e-6)
    assert errors == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT]


def test_grpc_embed_without_an_encoder_is_unimplemented():
    async def main():
        server, port = await start_grpc_server(None, "127.0.0.1", 0, "some-llm")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.GenerationStub(channel).Embed(pb.EmbedRequest(input=["a"]))
                return e.value.code()
        finally:
            await server.stop(grace=None)

    assert asyncio.run(main()) == grpc.StatusCode.UNIMPLEMENTED


# ---------------------------------------------------------------- chat completions with "rag"


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, smollm2_tokenizer_fields):
    """A tiny random LLM with SmolLM2's tokenizer and chat template: the text is noise, the
    prompt (what retrieval put into it) and the citations are what these tests check."""
    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from tests.test_cli import tiny_gguf

    path = tiny_gguf(tmp_path_factory.mktemp("llm") / "tiny.gguf", smollm2_tokenizer_fields,
                     max_position_embeddings=1024)
    engine = AsyncEngine(build_engine(str(path), num_pages=64, max_num_seqs=4,
                                      max_num_batched_tokens=64, max_model_len=1024,
                                      min_token_bucket=16, progress=False))
    yield engine
    engine.shutdown()


def test_chat_with_rag_puts_retrieved_text_in_the_prompt_and_cites_it(service, tiny_llm):
    from jaxserve.rag.prompt import RagRequest, augment_chat

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rag = {"collection": "geo", "top_k": 2, "mode": "bm25"}

    async def scenario(s, url):
        await _json(s, "POST", f"{url}/v1/collections", {"name": "geo"})
        await _json(s, "POST", f"{url}/v1/collections/geo/documents", {"documents": DOCS})
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
        plain = await client.chat.completions.create(model="tiny", messages=messages,
                                                     max_tokens=4)
        with_rag = await client.chat.completions.create(model="tiny", messages=messages,
                                                        max_tokens=4, extra_body={"rag": rag})
        stream = await client.chat.completions.create(model="tiny", messages=messages,
                                                      max_tokens=4, stream=True,
                                                      extra_body={"rag": rag})
        chunks = [c async for c in stream]
        errors = [await _json(s, "POST", f"{url}/v1/chat/completions",
                              {"model": "tiny", "messages": messages, "rag": bad})
                  for bad in ({"collection": "nope"}, {"collection": "geo", "top_k": 0},
                              {"collection": "geo", "mode": "fuzzy"}, "geo")]
        completion = await _json(s, "POST", f"{url}/v1/completions",
                                 {"model": "tiny", "prompt": "hi", "rag": rag})
        return plain, with_rag, chunks, errors, completion

    plain, with_rag, chunks, errors, completion = _serve(service, scenario, tiny_llm, "tiny")
    citations = with_rag.model_extra["citations"]
    assert citations[0]["document_id"] == "fr" and len(citations) == 2  # "France", "capital"
    assert {"document_id", "chunk_id", "score"} <= set(citations[0])
    # The prompt the model saw is the augmented one, with the retrieved text in it.
    augmented, expected = augment_chat(service, messages, RagRequest("geo", 2, "bm25"))
    assert expected == citations
    assert "Paris is the capital of France." in augmented[0]["content"]
    ids = tiny_llm.tokenizer.apply_chat_template(augmented, add_generation_prompt=True)
    assert with_rag.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    assert "citations" not in (plain.model_extra or {})
    assert chunks[0].model_extra["citations"] == citations
    assert [status for status, _ in errors] == [404, 400, 400, 400]
    assert errors[0][1]["error"]["message"] and errors[1][1]["error"]["param"] in ("rag", "top_k")
    assert completion[0] == 400 and completion[1]["error"]["param"] == "rag"


def test_chat_rag_on_a_server_without_retrieval_is_a_400(tiny_llm):
    async def scenario(s, url):
        return await _json(s, "POST", f"{url}/v1/chat/completions",
                           {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "rag": {"collection": "geo"}})

    status, body = _serve(None, scenario, tiny_llm, "tiny")
    assert status == 400 and "--no-rag" in body["error"]["message"]

"""Retrieval and gRPC Embed under hostile or careless callers (issue 35: H2, M6, M7), on real
servers (aiohttp on a free localhost port; grpc.aio) with the tiny random encoder."""

from __future__ import annotations

import asyncio
import os
import stat
import threading

import grpc
import pytest
from aiohttp import ClientSession

from jaxserve.config import ServerConfig
from jaxserve.entrypoints.grpc import MAX_RECEIVE_MESSAGE_BYTES, start_grpc_server
from jaxserve.entrypoints.http.app import build_app, start_server
from jaxserve.entrypoints.http.rag_routes import add_rag_routes
from jaxserve.entrypoints.serving.openai_serving import OpenAIServing
from jaxserve.entrypoints.serving.request_models import MAX_EMBEDDING_INPUTS
from jaxserve.gateway import Gateway
from jaxserve.gateway.tenants import load_tenants
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig, RagQuotas
from jaxserve.rag.service import RagService
from tests.rag_helpers import MINILM, tiny_embedder

TPM = 2000  # tokens per minute: refills 33 a second, small beside what the tests charge
LONG = "word " * 80  # truncated by the encoder to its 64 tokens


def _service(tmp_path, **config) -> RagService:
    return RagService(RagConfig(tmp_path / "rag", EmbedderConfig(max_batch=4, max_length=64),
                                ChunkerConfig(chunk_tokens=48, overlap_tokens=8), **config),
                      tiny_embedder())


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenant.acme]\napi_keys = ["sk-a"]\nmax_concurrent_requests = 1\n'
                    f'tokens_per_minute = {TPM}\n[tenant.bob]\napi_keys = ["sk-b"]\n')
    return path


@pytest.fixture
def service(tmp_path):
    service = _service(tmp_path)
    yield service
    service.close()


class Blocked:
    """Stands in for a service method: its first call blocks until `release` (on the thread it
    runs on, named in `threads`), later calls run at once."""

    def __init__(self, real):
        self.real, self.threads = real, []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, *args):
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 1:
            self.started.set()
            self.release.wait(30)
        return self.real(*args)


@pytest.fixture
def blocked(service, monkeypatch, request) -> Blocked:
    """The service's encoder (or the method named by the test's parameter), blocked on its first
    call."""
    method = getattr(request, "param", "embed")
    blocked = Blocked(getattr(service, method))
    monkeypatch.setattr(service, method, blocked)
    return blocked


async def _wait(event: threading.Event) -> None:
    for _ in range(300):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the work never started")


def _serve_http(service, tenants, scenario):
    async def main():
        app = build_app(ServerConfig(port=0, tenants_file=str(tenants)), "some-llm")
        add_rag_routes(app, service)
        runner, port = await start_server(app, "127.0.0.1", 0)
        try:
            return await scenario(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()
    return asyncio.run(main())


async def _post(url, key, body):
    async with ClientSession() as s:
        async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json(), resp.headers


async def _until_admitted(url, key, body):
    for _ in range(300):
        status, reply, headers = await _post(url, key, body)
        if status != 429:
            return status, reply, headers
        await asyncio.sleep(0.02)
    raise AssertionError("the slot never came back")


# ---------------------------------------------------------------- H2: gRPC Embed's bounds


def test_grpc_embed_is_bounded_as_http_embeddings(service, monkeypatch):
    calls = []
    real = service.embed
    monkeypatch.setattr(service, "embed", lambda texts: calls.append(len(texts)) or real(texts))

    async def main():
        server, port = await start_grpc_server(None, "127.0.0.1", 0, "some-llm", rag=service)
        codes = []
        try:
            async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}",
                    options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
                stub = pb_grpc.GenerationStub(channel)
                for inputs in ([""] * (MAX_EMBEDDING_INPUTS + 1), ["a", ""],
                               ["x" * (MAX_RECEIVE_MESSAGE_BYTES + 1)]):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Embed(pb.EmbedRequest(model=MINILM, input=inputs))
                    codes.append(e.value.code())
                reply = await stub.Embed(pb.EmbedRequest(model=MINILM, input=["a", "b"]))
        finally:
            await server.stop(grace=None)
        return codes, reply

    codes, reply = asyncio.run(main())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(reply.embeddings) == 2 and calls == [2]  # the refused ones never reached it


# ------------------------------------ M6: a client that leaves keeps its hold until the work ends


# Embeddings: 16 x 64 tokens; an upsert: 16 documents of 2 chunks (48 + 2, 40 + 2 tokens).
_WORK = {"embed": ("/v1/embeddings", {"model": MINILM, "input": [LONG] * 16}),
         "upsert": ("/v1/collections/kb/documents",
                    {"documents": [{"id": f"d{i}", "text": LONG} for i in range(16)]})}


@pytest.mark.parametrize("blocked", ["embed", "upsert"], indirect=True)
def test_http_client_that_leaves_keeps_its_slot_and_pays(service, blocked, tenants, request):
    path, body = _WORK[request.node.callspec.params["blocked"]]

    async def scenario(url):
        assert (await _post(f"{url}/v1/collections", "sk-a", {"name": "kb"}))[0] == 201
        first = asyncio.create_task(_post(f"{url}{path}", "sk-a", body))
        await _wait(blocked.started)
        first.cancel()  # the client leaves while the encoder runs
        await asyncio.sleep(0.2)
        while_running = (await _post(f"{url}{path}", "sk-a", body))[0]
        blocked.release.set()
        after = await _until_admitted(f"{url}/v1/embeddings", "sk-a",
                                      {"model": MINILM, "input": ["a"]})
        return while_running, after

    while_running, (status, _, headers) = _serve_http(service, tenants, scenario)
    assert while_running == 429 and status == 200
    # The ~1,000+ tokens the encoder read were paid although nobody took the answer.
    assert int(headers["x-ratelimit-remaining-tokens"]) < TPM - 700
    # On retrieval's own bounded threads, not the loop's default executor.
    assert blocked.threads and all(t.startswith("rag") for t in blocked.threads)


def test_grpc_embed_cancelled_keeps_its_slot_until_the_encoder_is_done(service, blocked,
                                                                        tenants):
    serving = OpenAIServing(None, "some-llm", gateway=Gateway(load_tenants(tenants)))
    key = [("authorization", "Bearer sk-a")]
    request = pb.EmbedRequest(model=MINILM, input=[LONG] * 16)

    async def main():
        server, port = await start_grpc_server(None, "127.0.0.1", 0, "some-llm", rag=service,
                                               serving=serving)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                call = stub.Embed(request, metadata=key)
                await _wait(blocked.started)
                call.cancel()
                await asyncio.sleep(0.2)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Embed(pb.EmbedRequest(model=MINILM, input=["a"]), metadata=key)
                blocked.release.set()
                for _ in range(300):
                    try:
                        await stub.Embed(pb.EmbedRequest(model=MINILM, input=["a"]),
                                         metadata=key)
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.02)
                remaining = serving.gateway.headers(serving.gateway.authenticate("Bearer sk-a"))
                return e.value.code(), int(remaining["x-ratelimit-remaining-tokens"])
        finally:
            await server.stop(grace=None)

    code, remaining = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and remaining < TPM - 700


# ------------------------------------------------ M7: ingest's tokens, quotas, files, descriptors


def test_upsert_charges_the_tokens_the_encoder_read(service, tenants):
    async def scenario(url):
        assert (await _post(f"{url}/v1/collections", "sk-a", {"name": "kb"}))[0] == 201
        docs = [{"id": f"d{i}", "text": LONG} for i in range(8)]  # 16 chunks of <= 48 tokens
        return await _post(f"{url}/v1/collections/kb/documents", "sk-a", {"documents": docs})

    status, body, headers = _serve_http(service, tenants, scenario)
    assert status == 200 and body["chunks"] == 16
    assert int(headers["x-ratelimit-remaining-tokens"]) < TPM - 500


def test_each_tenant_has_quotas_on_collections_documents_and_bytes(tmp_path, tenants):
    service = _service(tmp_path, quotas=RagQuotas(max_collections=2, max_documents=3,
                                                  max_bytes=1 << 20))

    async def scenario(url):
        c = f"{url}/v1/collections"
        out = [(await _post(c, "sk-a", {"name": name}))[:2] for name in ("a1", "a2", "a3")]
        out.append((await _post(c, "sk-b", {"name": "b1"}))[:2])  # another tenant's own quota
        docs = [{"id": f"d{i}", "text": "some text"} for i in range(3)]
        out.append((await _post(f"{c}/a1/documents", "sk-a", {"documents": docs}))[:2])
        out.append((await _post(f"{c}/a1/documents", "sk-a", {"documents": docs[:1]}))[:2])
        out.append((await _post(f"{c}/a2/documents", "sk-a",
                                {"documents": [{"id": "e", "text": "one more"}]}))[:2])
        return out

    out = _serve_http(service, tenants, scenario)
    assert [status for status, _ in out] == [201, 201, 429, 201, 200, 200, 429]
    for _, body in (out[2], out[6]):
        assert body["error"]["code"] == "insufficient_quota"
    assert "2 collections" in out[2][1]["error"]["message"]
    service.close()


def test_a_tenant_over_its_byte_quota_adds_nothing(tmp_path):
    service = _service(tmp_path, quotas=RagQuotas(max_bytes=300_000))
    from jaxserve.errors import QuotaExceeded
    from jaxserve.rag.documents import Document

    service.create_collection("kb", "acme")
    with pytest.raises(QuotaExceeded, match="bytes"):
        service.upsert("kb", [Document("big", "x" * 400_000, {})], "acme")
    assert service.collection("kb").info()["documents"] == 0
    service.upsert("kb", [Document("small", "some text", {})], "acme")
    service.upsert("kb", [Document("small", "some text", {})], None)  # the CLI has no quota
    service.close()


def test_open_collections_are_bounded_and_files_are_private(tmp_path):
    from jaxserve.rag.documents import Document

    service = _service(tmp_path, max_open_collections=2)
    root = tmp_path / "rag" / "collections"

    def open_files() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(root))
                   for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    for i in range(6):
        service.create_collection(f"c{i}", "acme")
        service.upsert(f"c{i}", [Document(f"d{i}", f"text number {i}", {})], "acme")
        assert open_files() <= 2 * 3  # SQLite, its WAL and shared memory per open collection
    # Closed ones reopen on use with what they held.
    assert [r.document_id for r in service.search("c0", "text", 1, "bm25", tenant="acme")] == \
        ["d0"]
    assert service.collection_infos("acme")[0] == {"name": "c0", "documents": 1, "chunks": 1,
                                                   "index": "exact"}
    assert open_files() <= 2 * 3
    for path in [root, *root.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in root.glob("*/*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    service.close()

"""OpenTelemetry traces end to end: a real server (a tiny random model with SmolLM2's tokenizer,
chunked prefill, n-gram speculation, a policy pack and retrieval) exports over OTLP/HTTP to a
loopback receiver started here, which decodes the protobuf (opentelemetry-proto). Checked: the
span tree of a request (every phase a child of the request's span), the trace id and parent
span id taken from the caller's W3C traceparent on HTTP and on gRPC, the GenAI attributes, and
that a server without --otlp-traces-endpoint loads no OpenTelemetry at all."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from jaxserve.protos import generation_pb2 as pb
from jaxserve.protos import generation_pb2_grpc as pb_grpc
from tests.otlp_receiver import Receiver
from tests.test_server import ServerThread, _request, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
POLICY = """
[[pack.default.rule]]
name = "email"
stage = "both"
match = "pii:email"
action = "redact"
"""
DOCS = [{"id": "paris", "text": "Paris is the capital of France. It lies on the Seine."},
        {"id": "rome", "text": "Rome is the capital of Italy, on the Tiber."}]


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                       else getattr(v, kind))
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory, smollm2_tokenizer_fields):
    import os

    from jaxserve.core.async_engine import AsyncEngine
    from jaxserve.core.engine_factory import build_engine
    from jaxserve.entrypoints.grpc import start_grpc_server
    from jaxserve.entrypoints.http.app import serving_of
    from jaxserve.rag.config import ChunkerConfig, EmbedderConfig, RagConfig
    from jaxserve.rag.service import RagService
    from tests.rag_helpers import tiny_embedder
    from tests.test_cli import tiny_gguf

    receiver = Receiver()
    d = tmp_path_factory.mktemp("traced")
    (d / "policy.toml").write_text(POLICY)
    # The SDK's batch processor reads its delay when built: spans go out within 50 ms.
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    rag = RagService(RagConfig(d / "rag", EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)), tiny_embedder())
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=512)
    # Batches of 32 tokens: a prompt of ~100 tokens is prefilled in several chunks.
    engine = AsyncEngine(build_engine(str(path), num_pages=64, max_num_seqs=4,
                                      max_num_batched_tokens=32, max_model_len=512,
                                      min_token_bucket=16, speculative_ngram=2, progress=False))
    http = ServerThread("tiny", rag, otlp_traces_endpoint=receiver.url,
                        policy_file=str(d / "policy.toml"))
    del os.environ["OTEL_BSP_SCHEDULE_DELAY"]
    http.attach(engine)
    grpc_server, port = http._call(start_grpc_server(engine, "127.0.0.1", 0, "tiny",
                                                     serving=serving_of(http.app)))
    yield http, receiver, f"127.0.0.1:{port}"
    http._call(grpc_server.stop(grace=None))
    http.stop()  # sends the spans still queued
    engine.shutdown()
    rag.close()
    receiver.close()


def test_a_request_is_one_span_with_a_child_per_phase_under_the_callers_trace(traced):
    http, receiver, _ = traced
    r = _request("POST", f"{http.url}/v1/collections", {"name": "geo"})
    assert r.status_code in (200, 201), r.text
    r = _request("POST", f"{http.url}/v1/collections/geo/documents", {"documents": DOCS})
    assert r.status_code == 200, r.text
    question = "Which city is the capital of France? " * 8 + "Write to me at a@b.example."
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0, "response_format": {"type": "json_object"},
            "rag": {"collection": "geo", "top_k": 1, "mode": "bm25"}}
    r = _request("POST", f"{http.url}/v1/chat/completions", body,
                 headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]

    def request_span():
        return next((s for s in receiver.trace(bytes.fromhex(TRACE_ID))
                     if s.parent_span_id == bytes.fromhex(PARENT_ID)), None)

    root = wait_for(request_span, "the request's span at the receiver", 30)
    assert root.name == "chat tiny" and root.kind == root.SPAN_KIND_SERVER
    a = attrs(root)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.response.model"] == "tiny" and a["gen_ai.response.id"] == r.json()["id"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert a["http.response.status_code"] == 200 and a["jaxserve.outcome"] == "ok"
    children = [s for s in receiver.trace(root.trace_id) if s.parent_span_id == root.span_id]
    names = [s.name for s in children]
    for phase in ("policy_screening", "retrieval", "grammar_compile", "admission", "queue",
                  "decode"):
        assert names.count(phase) == 1, (phase, names)
    chunks = sorted((s for s in children if s.name == "prefill_chunk"),
                    key=lambda s: s.start_time_unix_nano)
    assert len(chunks) >= 2, names  # the prompt exceeds a 32-token batch
    assert sum(attrs(c)["jaxserve.prefill.num_tokens"] for c in chunks) == usage["prompt_tokens"]
    by_name = {s.name: s for s in children}
    decode = attrs(by_name["decode"])
    assert decode["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert {"jaxserve.spec_decode.num_draft_tokens",
            "jaxserve.spec_decode.num_accepted_tokens"} <= set(decode)
    # Within the request, in order: admitted, queued, prefilled chunk by chunk, then decoded.
    for s in children:
        assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano \
            <= root.end_time_unix_nano, s.name
    assert by_name["admission"].end_time_unix_nano <= by_name["queue"].end_time_unix_nano \
        <= chunks[0].start_time_unix_nano
    assert chunks[-1].end_time_unix_nano <= by_name["decode"].start_time_unix_nano


def test_grpc_metadata_traceparent_and_a_malformed_one(traced):
    http, receiver, target = traced
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(target))
    replies = list(stub.Generate(pb.GenerateRequest(model="tiny", prompt="hello", max_tokens=3),
                                 metadata=(("traceparent", f"00-{trace_id}-b7ad6b7169203331-01"),)))
    assert replies
    root = wait_for(lambda: next((s for s in receiver.trace(bytes.fromhex(trace_id))
                                  if s.name == "text_completion tiny"), None), "the gRPC span", 30)
    assert root.parent_span_id == bytes.fromhex("b7ad6b7169203331")
    assert attrs(root)["jaxserve.transport"] == "grpc"
    # A malformed traceparent is ignored (a new trace), never a refusal.
    before = len(receiver.spans)
    r = _request("POST", f"{http.url}/v1/completions",
                 {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                 headers={"traceparent": "00-zz-" + "x" * 4000})
    assert r.status_code == 200, r.text
    fresh = wait_for(lambda: next((s for s in receiver.spans[before:]
                                   if s.name == "text_completion tiny"
                                   and attrs(s)["gen_ai.response.id"] == r.json()["id"]), None),
                     "the span of the malformed traceparent's request", 30)
    assert fresh.parent_span_id == b"" and fresh.trace_id != bytes.fromhex(trace_id)


def test_without_the_flag_no_opentelemetry_is_loaded():
    code = ("import sys; from jaxserve.config import ServerConfig; "
            "from jaxserve.entrypoints.http.app import build_app; "
            "from jaxserve.entrypoints.http.app_state import STATE_KEY; "
            "app = build_app(ServerConfig(), 'm'); assert app[STATE_KEY].tracing is None; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert json.loads(out) == []

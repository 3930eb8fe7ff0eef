"""GET /openapi.json describes every route from the definitions the parser uses, and schemathesis
fuzzes a real server (tiny random model, tiny random encoder) from that description: valid and
invalid bodies, path parameters, for every route. Nothing may answer 5xx, and every answer must
be one the description documents (status, content type, JSON schema)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.config import RequestLimits
from jaxserve.core.engine_factory import build_engine
from jaxserve.rag.config import EMBEDDING_MODEL, ChunkerConfig, EmbedderConfig, RagConfig
from jaxserve.rag.service import RagService
from jaxserve.entrypoints.http.openapi import ROUTES_KEY
from tests.rag_helpers import tiny_embedder
from tests.test_cli import tiny_gguf
from tests.test_engine import assert_no_leaks
from tests.test_server import ServerThread, http_get, wait_for

TINY = "tiny"
# Small limits keep every valid request cheap on a 2-core CI box; the description carries them.
LIMITS = RequestLimits(max_n=2, max_prompts=2, max_stop=2, max_stop_length=8, max_messages=4,
                       max_body_bytes=64 * 1024, max_json_depth=16)
EXAMPLES = 20  # per operation and mode: about 700 requests, a minute or two on a 2-core box
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, smollm2_tokenizer_fields):
    path = tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", smollm2_tokenizer_fields)
    llm_engine = build_engine(str(path), num_pages=48, max_num_seqs=4,
                              max_num_batched_tokens=32, max_model_len=64,
                              min_token_bucket=16, strict_compile=True, progress=False)
    rag = RagService(RagConfig(tmp_path_factory.mktemp("rag"),
                               EmbedderConfig(max_batch=4, max_length=64),
                               ChunkerConfig(chunk_tokens=48, overlap_tokens=8)), tiny_embedder())
    engine = AsyncEngine(llm_engine)
    srv = ServerThread(TINY, rag, limits=LIMITS)
    srv.attach(engine)
    srv.llm_engine = llm_engine
    yield srv
    srv.stop()
    engine.shutdown()
    rag.close()
    assert llm_engine.runner.num_serving_compiles == 0
    llm_engine.scheduler.cache.expire_pins(float("inf"))  # the fuzzer's pins (see below)
    assert_no_leaks(llm_engine)


def test_the_description_covers_every_route(fuzz_server):
    doc = http_get(f"{fuzz_server.url}/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    served = {(r.method.lower(), r.resource.canonical) for r in fuzz_server.app.router.routes()
              if r.method != "HEAD"}
    described = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served == described and len(fuzz_server.app[ROUTES_KEY]) == len(served)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert chat["properties"]["messages"]["maxItems"] == LIMITS.max_messages
    assert {"maximum": LIMITS.max_n, "type": "integer"} in chat["properties"]["n"]["anyOf"]


_CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
_DOC = {"id": "d1", "text": "Paris is the capital of France.", "metadata": {"lang": "en"}}
# Requests that succeed, one or more per route, so every successful answer (streams included) is
# checked against its description on each run, whatever the fuzzer happens to draw.
KNOWN_GOOD = [
    ("POST", "/v1/chat/completions", {**_CHAT, "n": 2, "logprobs": True, "top_logprobs": 2}),
    ("POST", "/v1/chat/completions", {**_CHAT, "stream": True, "logprobs": True,
                                      "stream_options": {"include_usage": True}}),
    ("POST", "/v1/completions", {"model": TINY, "prompt": ["a", "b"], "max_tokens": 3,
                                 "logprobs": 2}),
    ("POST", "/v1/completions", {"model": TINY, "prompt": [5, 6], "max_tokens": 3, "echo": True,
                                 "stream": True, "stream_options": {"include_usage": True}}),
    # the prompt's logprobs: echoed (null first), scored only, and vLLM's prompt_logprobs
    ("POST", "/v1/completions", {"model": TINY, "prompt": [5, 6, 7], "max_tokens": 2,
                                 "echo": True, "logprobs": 1, "prompt_logprobs": 2}),
    ("POST", "/v1/completions", {"model": TINY, "prompt": "a b", "max_tokens": 0, "echo": True,
                                 "logprobs": 0, "stream": True}),
    ("POST", "/v1/chat/completions", {**_CHAT, "prompt_logprobs": 1}),
    ("GET", "/v1/models", None), ("GET", "/health", None), ("GET", "/ready", None),
    ("GET", "/metrics", None), ("GET", "/tokenizer_info", None),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/tokenize", {"messages": _CHAT["messages"]}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("POST", "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": ["a", "b"]}),
    ("POST", "/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "a",
                                "encoding_format": "base64"}),
    ("POST", "/v1/collections", {"name": "kb"}),
    ("GET", "/v1/collections", None),
    ("POST", "/v1/collections/{name}/documents", {"documents": [_DOC]}),
    ("POST", "/v1/collections/{name}/search", {"query": "capital", "top_k": 1}),
    ("DELETE", "/v1/collections/{name}/documents/{document_id}", None),
    ("DELETE", "/v1/collections/{name}", None),
]


def test_successful_answers_of_every_route_conform(fuzz_server):
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    for method, path, body in KNOWN_GOOD:
        case = api[path][method].Case(
            path_parameters={"name": "kb", "document_id": "d1"} if "{" in path else None,
            **({"body": body, "media_type": "application/json"} if body is not None else {}))
        response = case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=60)
        assert response.status_code in (200, 201), (method, path, response.text[:500])


def _served_model(case, named: bool):
    """Most generated `model` names are unknown (a quick 404): name the served one in about
    half the bodies, so generation and embedding themselves are fuzzed too."""
    if named and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = EMBEDDING_MODEL if case.operation.path == "/v1/embeddings" else TINY
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_5xx_and_answers_conform(fuzz_server, mode):
    """Every operation of the served description, EXAMPLES generated requests each: bodies that
    fit the description, then bodies that do not (each of those must be a 4xx)."""
    api = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    # (schemathesis leaves out the route its description came from: /openapi.json)
    assert len(operations) == len(fuzz_server.app[ROUTES_KEY]) - 1
    if mode.is_negative:  # only a body can be made to not fit (path parameters are any string)
        operations = [op for op in operations if op.body]
    for operation in operations:
        # (a body made not to fit keeps its model: the violation may be that very field)
        @given(case=st.tuples(operation.as_strategy(generation_mode=mode),
                              st.booleans() if mode.is_positive else st.just(False)).map(
            lambda pair: _served_model(*pair)))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def check(case):
            note(f"{mode} {operation.method.upper()} {operation.path}")
            case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=60)

        check()


def test_the_fuzzed_server_is_idle_and_ready_after(fuzz_server):
    """No request runs, waits or holds a page. A fuzzed chat may carry a prompt_cache_breakpoint,
    whose pin holds its prompt's pages for minutes by design: only pinned pages may stay held."""
    def idle():
        s = fuzz_server.llm_engine.stats()
        return s.num_running == s.num_waiting == 0 and s.pages_in_use <= s.pinned_pages
    wait_for(idle, "the engine to go idle")
    fuzz_server.llm_engine.scheduler.cache.check_invariants()
    assert http_get(f"{fuzz_server.url}/ready").json() == {"status": "ready"}

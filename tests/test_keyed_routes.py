"""Keyed routes beside chat and completions, on a real server over a tiny random model with a
tenants file (review a70e490): /v1/responses honours Idempotency-Key as the other generation
routes do (L10: a retry replays, the model does not run again); /tokenize and /detokenize
without `model` still check that the tenant may use the served model (L14); a model that does not
exist is a 404 that names no other model (L1)."""

from __future__ import annotations

import json

import pytest

from jaxserve.core.async_engine import AsyncEngine
from jaxserve.core.engine_factory import build_engine
from tests.test_cli import tiny_gguf
from tests.test_server import ServerThread, _request

TENANTS = """
[tenant.alice]
api_keys = ["sk-alice"]

[tenant.mallory]
api_keys = ["sk-mallory"]
models = ["public-*"]
"""
RESPONSE = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer_fields):
    d = tmp_path_factory.mktemp("keyed")
    (d / "tenants.toml").write_text(TENANTS)
    path = tiny_gguf(d / "tiny.gguf", smollm2_tokenizer_fields, max_position_embeddings=64)
    # the fewest programs to compile: token buckets 16 and 32, one row
    llm = build_engine(str(path), num_pages=12, max_num_seqs=1, max_num_batched_tokens=32,
                       max_model_len=64, min_token_bucket=16, progress=False)
    engine = AsyncEngine(llm)
    http = ServerThread("tiny", tenants_file=str(d / "tenants.toml"))
    try:
        http.attach(engine)
        yield http
    finally:
        http.stop()
        engine.shutdown()


def _post(server, path, body, key="sk-alice", **headers):
    return _request("POST", f"{server.url}{path}", body,
                    headers={"Authorization": f"Bearer {key}", **headers})


@pytest.mark.parametrize("stream", [False, True])
def test_responses_replay_an_idempotency_key(server, stream):
    body = {**RESPONSE, "stream": stream}
    key = {"Idempotency-Key": f"resp-{stream}"}
    first = _post(server, "/v1/responses", body, **key)
    again = _post(server, "/v1/responses", body, **key)
    assert first.status_code == again.status_code == 200, first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.text == first.text  # the same id and text (sampled at temperature 1)
    if stream:
        assert "event: response.incomplete" in again.text  # cut by max_output_tokens
    else:
        assert json.loads(first.text)["id"].startswith("resp")
    other = _post(server, "/v1/responses", {**body, "input": "Other"}, **key)
    assert other.status_code == 422  # the key on another body
    assert "idempotent-replayed" not in _post(server, "/v1/responses", body).headers


def test_tokenize_without_model_checks_the_tenants_models(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        r = _post(server, path, body, key="sk-mallory")
        assert r.status_code == 404 and json.loads(r.text)["error"]["code"] == \
            "model_not_found", (path, r.text)
        assert _post(server, path, body).status_code == 200, path


def test_an_unknown_model_names_no_other(server):
    for key in ("sk-mallory", "sk-alice"):  # mallory may use public-* only
        r = _post(server, "/v1/chat/completions", {
            "model": "public-nope", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1}, key=key)
        assert r.status_code == 404, r.text
        assert "tiny" not in json.loads(r.text)["error"]["message"], key

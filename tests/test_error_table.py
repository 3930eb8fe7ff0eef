"""The one table from typed errors to HTTP / gRPC / batch status, and what the front ends read
beside it: Retry-After and the metrics outcome."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.errors import (ContentPolicyViolation, DeadlineExceeded, EngineOverloaded,
                             FailedDependency, IdempotencyConflict,
                             InvalidRequest, MethodNotAllowed, NoChatTemplate, NotFound,
                             QueueTimeout, QuotaExceeded, RateLimitExceeded, RequestFailed,
                             TokenizerError, Unauthenticated, error_reply, error_status, outcome,
                             retry_after)


@pytest.mark.parametrize("error, http, grpc, code", [
    (Unauthenticated("no key"), 401, "UNAUTHENTICATED", "invalid_api_key"),
    (RateLimitExceeded("slow down", 2.5), 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded"),
    (QueueTimeout("waited", 1.0), 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded"),
    (QuotaExceeded("full"), 429, "RESOURCE_EXHAUSTED", "insufficient_quota"),
    (EngineOverloaded("full", 1.0), 503, "RESOURCE_EXHAUSTED", "overloaded"),
    (DeadlineExceeded("late"), 504, "DEADLINE_EXCEEDED", "deadline_exceeded"),
    (IdempotencyConflict("running"), 409, "ABORTED", "idempotency_conflict"),
    # a chat to a model without a chat template is the caller's 400, not a 500
    (NoChatTemplate("no template"), 400, "INVALID_ARGUMENT", None),
    (RequestFailed("boom"), 500, "INTERNAL", None),
    # the HTTP router's refusals
    (NotFound("Invalid URL (GET /v1/x)"), 404, "NOT_FOUND", "not_found"),
    (MethodNotAllowed("GET", ("POST",)), 405, "UNIMPLEMENTED", "method_not_allowed"),
    (ContentPolicyViolation("sesame", "messages"), 400, "INVALID_ARGUMENT",
     "content_policy_violation"),
    # OpenAI's answer when a remote MCP server cannot list its tools
    (FailedDependency("no listing", "tools"), 424, "UNAVAILABLE", "http_error"),
])
def test_each_error_has_one_status(error, http, grpc, code):
    status = error_status(error)
    assert (status.http, status.grpc, status.code) == (http, grpc, code)
    assert error_reply(error)[0] == http


def test_no_chat_template_names_messages_and_stays_a_tokenizer_error():
    error = NoChatTemplate("this model has no chat template")
    assert isinstance(error, TokenizerError) and isinstance(error, InvalidRequest)
    assert error_reply(error)[1]["error"]["param"] == "messages"


def test_retry_after_only_where_a_retry_may_pass():
    assert retry_after(RateLimitExceeded("x", 3.0)) == 3.0
    assert retry_after(RateLimitExceeded("never", None)) is None
    assert retry_after(EngineOverloaded("x", 1.0)) == 1.0
    assert retry_after(DeadlineExceeded("x")) is None


def test_outcomes():
    assert outcome(None) == "ok"
    assert outcome(EngineOverloaded("shed")) == "shed"
    assert outcome(DeadlineExceeded("late")) == "deadline"
    assert outcome(asyncio.CancelledError()) == "client_disconnected"
    assert outcome(RateLimitExceeded("x")) == "429_rate_limit_exceeded"
    assert outcome(InvalidRequest("x")) == "400_invalid_request_error"
    assert outcome(RuntimeError("x")) == "500_server_error"

"""Errors a user can hit, and the one table that maps each to an HTTP / gRPC / batch status."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class JaxServeError(Exception):
    """Base class: the message is meant for the user, one line, naming the fix where there is one."""


class ConfigError(JaxServeError):
    """A configuration value is invalid."""


class ModelNotFound(JaxServeError):
    """Unknown model name or missing model files."""


class WeightsError(JaxServeError):
    """Weights are unreadable, corrupted, or of an unsupported architecture."""


class TokenizerError(JaxServeError):
    """The tokenizer cannot be built or lacks what was asked (e.g. a chat template)."""


class InvalidRequest(JaxServeError):
    """A request parameter is malformed or out of range."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoChatTemplate(InvalidRequest, TokenizerError):
    """Chat messages sent to a model without a chat template: the caller's 400 (`messages`),
    still a TokenizerError to code that asks the tokenizer directly."""

    def __init__(self, message: str):
        super().__init__(message, "messages")


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens exceed the model's context."""


class ContentPolicyViolation(InvalidRequest):
    """The content policy blocked the prompt (HTTP 400 `content_policy_violation`, gRPC
    INVALID_ARGUMENT): nothing was generated. The message names the rule, never the text."""

    def __init__(self, rule: str, param: str | None = None, interventions: tuple = ()):
        # The code leads the message: it is what a gRPC client sees in the status details.
        super().__init__(f"content_policy_violation: the request was blocked by the content "
                         f"policy (rule {rule!r})", param)
        self.rule = rule
        self.interventions = interventions  # every rule that acted (the audit record's)


class EngineOverloaded(JaxServeError):
    """The engine cannot take more requests right now (HTTP 503 `overloaded`): the queue is full,
    or the request was shed from it for a more important one. `retry_after`: seconds, a hint."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RateLimitExceeded(JaxServeError):
    """A tenant's limit refuses the request (HTTP 429 `rate_limit_exceeded`). `retry_after`:
    seconds until the same request would pass, None when it never can (larger than the limit)."""

    def __init__(self, message: str, retry_after: float | None = None, param: str | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        self.param = param


class QuotaExceeded(RateLimitExceeded):
    """What a tenant stores would pass its quota (HTTP 429 `insufficient_quota`, OpenAI's code
    for a quota): no retry passes until something is deleted or the quota is raised."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, None, param)


class QueueTimeout(RateLimitExceeded):
    """The request waited its tenant's max_queue_time_s without starting; nothing was generated."""


class DeadlineExceeded(JaxServeError):
    """The request's deadline passed, queued or mid-generation (HTTP 504 `deadline_exceeded`)."""


class Unauthenticated(JaxServeError):
    """Missing or unknown API key (HTTP 401 `invalid_api_key`, gRPC UNAUTHENTICATED)."""


class Forbidden(JaxServeError):
    """The request may not be made from where it comes: an open server's foreign Host or
    browser Origin, or /metrics to a client it is not open to; or by whom it comes: a tool the
    tenant may not use, naming the field (HTTP 403 `forbidden`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnsupportedMediaType(JaxServeError):
    """A JSON route's body is not declared JSON (HTTP 415, naming Content-Type)."""


class IdempotencyConflict(JaxServeError):
    """A request with this Idempotency-Key is still being processed (HTTP 409)."""


class IdempotencyMismatch(JaxServeError):
    """This Idempotency-Key was used with a different request body (HTTP 422)."""


class EngineDead(JaxServeError):
    """The engine loop stopped; no request can be served."""


class PrefillFailed(JaxServeError):
    """A decode server's prefill server (serve --role decode) failed the request: it could not
    be reached, it went away or timed out, or what it sent was not the pages asked for."""


class NotFound(JaxServeError):
    """A named resource other than a model (a collection, a document, a URL) does not exist."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class MethodNotAllowed(JaxServeError):
    """The path exists, but not with this HTTP method (405, with `Allow`: `allowed`)."""

    def __init__(self, message: str, allowed: tuple[str, ...]):
        super().__init__(message)
        self.allowed = allowed


class AlreadyExists(JaxServeError):
    """Creating a named resource that exists already."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailed(JaxServeError):
    """One request failed inside the engine; the engine and the other requests go on."""


class Conflict(JaxServeError):
    """The request contradicts the current state (a version still routed to, one still loading)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class FailedDependency(JaxServeError):
    """A service the request names failed it: a remote MCP server whose tools could not be
    listed (HTTP 424 `external_connector_error`, as OpenAI answers it), naming the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InsufficientMemory(JaxServeError):
    """A model version does not fit in the memory that is free."""


@dataclass(frozen=True)
class ErrorStatus:
    """How one kind of error reaches a client: HTTP status (also a batch line's status_code),
    gRPC status code name, and the OpenAI error body's `type` and `code`."""

    http: int
    grpc: str  # a grpc.StatusCode name; this module stays free of grpc
    type: str
    code: str | None = None


# The one table from typed errors to statuses; the first matching class wins (subclasses first).
_STATUS_TABLE: tuple[tuple[type[Exception], ErrorStatus], ...] = (
    (ModelNotFound, ErrorStatus(404, "NOT_FOUND", "invalid_request_error", "model_not_found")),
    (NotFound, ErrorStatus(404, "NOT_FOUND", "invalid_request_error", "not_found")),
    (MethodNotAllowed, ErrorStatus(405, "UNIMPLEMENTED", "invalid_request_error",
                                   "method_not_allowed")),
    (AlreadyExists, ErrorStatus(409, "ALREADY_EXISTS", "invalid_request_error", "already_exists")),
    (ContextLengthExceeded, ErrorStatus(400, "INVALID_ARGUMENT", "invalid_request_error",
                                        "context_length_exceeded")),
    (ContentPolicyViolation, ErrorStatus(400, "INVALID_ARGUMENT", "invalid_request_error",
                                         "content_policy_violation")),
    (InvalidRequest, ErrorStatus(400, "INVALID_ARGUMENT", "invalid_request_error")),
    (EngineOverloaded, ErrorStatus(503, "RESOURCE_EXHAUSTED", "server_error", "overloaded")),
    (EngineDead, ErrorStatus(503, "UNAVAILABLE", "server_error", "overloaded")),
    (PrefillFailed, ErrorStatus(502, "UNAVAILABLE", "server_error", "prefill_failed")),
    # the gateway's (QueueTimeout is a RateLimitExceeded), as their docstrings say
    (QuotaExceeded, ErrorStatus(429, "RESOURCE_EXHAUSTED", "insufficient_quota",
                                "insufficient_quota")),
    (RateLimitExceeded, ErrorStatus(429, "RESOURCE_EXHAUSTED", "rate_limit_error",
                                    "rate_limit_exceeded")),
    (DeadlineExceeded, ErrorStatus(504, "DEADLINE_EXCEEDED", "timeout_error",
                                   "deadline_exceeded")),
    (Unauthenticated, ErrorStatus(401, "UNAUTHENTICATED", "invalid_request_error",
                                  "invalid_api_key")),
    (Forbidden, ErrorStatus(403, "PERMISSION_DENIED", "invalid_request_error", "forbidden")),
    (UnsupportedMediaType, ErrorStatus(415, "INVALID_ARGUMENT", "invalid_request_error",
                                       "unsupported_media_type")),
    (FailedDependency, ErrorStatus(424, "UNAVAILABLE", "external_connector_error",
                                   "http_error")),
    (IdempotencyConflict, ErrorStatus(409, "ABORTED", "invalid_request_error",
                                      "idempotency_conflict")),
    (IdempotencyMismatch, ErrorStatus(422, "FAILED_PRECONDITION", "invalid_request_error",
                                      "idempotency_key_reused")),
    # the fleet's (the admin API)
    (Conflict, ErrorStatus(409, "FAILED_PRECONDITION", "invalid_request_error", "conflict")),
    (InsufficientMemory, ErrorStatus(409, "RESOURCE_EXHAUSTED", "invalid_request_error",
                                     "insufficient_memory")),
)
_INTERNAL = ErrorStatus(500, "INTERNAL", "server_error")


def error_status(error: BaseException) -> ErrorStatus:
    """The status of any exception; anything untyped (RequestFailed included) is internal."""
    for cls, status in _STATUS_TABLE:
        if isinstance(error, cls):
            return status
    return _INTERNAL


def retry_after(error: BaseException) -> float | None:
    """Seconds after which the same request may pass (429, 503), or None: the Retry-After
    header / gRPC `retry-after` trailing metadata of the reply."""
    value = getattr(error, "retry_after", None)
    return value if isinstance(error, (RateLimitExceeded, EngineOverloaded)) else None


def outcome(error: BaseException | None) -> str:
    """A request's outcome as the `outcome` label of jaxserve:requests_total: "ok", "shed" (503,
    refused or displaced by load), "deadline" (504), "client_disconnected", or the
    status and code of any other error ("429_rate_limit_exceeded", "400_invalid_request_error",
    "500_server_error")."""
    if error is None:
        return "ok"
    if isinstance(error, (asyncio.CancelledError, ConnectionResetError)):
        return "client_disconnected"
    if isinstance(error, EngineOverloaded):
        return "shed"
    if isinstance(error, DeadlineExceeded):
        return "deadline"
    status = error_status(error)
    return f"{status.http}_{status.code or status.type}"


def version_fault(error: BaseException | None) -> bool:
    """Whether a request's end counts against the model version that served it (the canary
    gate's error rate): a server error is its fault; the client's bad input or departure, a
    shed under load and a deadline are not."""
    outcome_ = outcome(error)
    return outcome_.startswith("5") and not isinstance(error, EngineOverloaded)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_reply(error: BaseException) -> tuple[int, dict]:
    """The HTTP status (a batch line's status_code too) and OpenAI error body of any exception."""
    status = error_status(error)
    # An untyped error's text may name paths, SQL or other internals: the log has it, the
    # client gets a generic message.
    message = (str(error) if isinstance(error, JaxServeError)
               else "The server had an error while processing your request (the server's log "
                    "has the details)")
    # An unknown model names `model`; other errors name their field, if any.
    param = "model" if isinstance(error, ModelNotFound) else getattr(error, "param", None)
    return status.http, error_body(message, status.type, param, status.code)


# Anthropic's error `type` for each HTTP status (its Messages API routes answer in its shape).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    402: "billing_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(status: int, body: dict) -> dict:
    """Anthropic's error body for the status and OpenAI error body `error_reply` gave."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}

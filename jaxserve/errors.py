"""Errors a user can hit. Each is typed so the front ends map it once to an HTTP / gRPC status."""

from __future__ import annotations


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


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus max_tokens exceed the model's context."""


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


class QueueTimeout(RateLimitExceeded):
    """The request waited its tenant's max_queue_time_s without starting; nothing was generated."""


class DeadlineExceeded(JaxServeError):
    """The request's deadline passed, queued or mid-generation (HTTP 504 `deadline_exceeded`)."""


class Unauthenticated(JaxServeError):
    """Missing or unknown API key (HTTP 401 `invalid_api_key`, gRPC UNAUTHENTICATED)."""


class IdempotencyConflict(JaxServeError):
    """A request with this Idempotency-Key is still being processed (HTTP 409)."""


class IdempotencyMismatch(JaxServeError):
    """This Idempotency-Key was used with a different request body (HTTP 422)."""


class EngineDead(JaxServeError):
    """The engine loop stopped; no request can be served."""


class NotFound(JaxServeError):
    """A named resource other than a model (a collection, a document) does not exist."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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


class InsufficientMemory(JaxServeError):
    """A model version does not fit in the memory that is free."""

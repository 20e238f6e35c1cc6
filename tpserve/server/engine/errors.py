"""Errors the engine raises towards the HTTP layer; each maps to one HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class; ``status`` is the HTTP status and ``type`` OpenAI's error type."""

    status = 500
    type = "internal_error"


class EngineDeadError(EngineError):
    """The engine (or one of its ranks) failed; no further requests can be served."""

    status = 503
    type = "service_unavailable"


class EngineShuttingDownError(EngineError):
    """The server is draining for shutdown and accepts no new requests."""

    status = 503
    type = "service_unavailable"


class EngineOverloadedError(EngineError):
    """The queue is full; the client should retry after ``retry_after`` seconds."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLongError(EngineError):
    """Prompt plus max_tokens exceed the model's context."""

    status = 400
    type = "invalid_request_error"


class InvalidRequestError(EngineError):
    """The request cannot be served as given (empty prompt, token ids out of range)."""

    status = 400
    type = "invalid_request_error"


class ConflictError(EngineError):
    """The query lost to a later one that undid it (a pause of mode wait called off by
    /resume before it completed): nothing failed, the engine is as the later one left it."""

    status = 409
    type = "conflict"


class EngineTimeoutError(EngineError):
    """The engine did not answer a query in time (it may be stuck in a long step)."""

    status = 504
    type = "timeout_error"


class RequestAbortedError(EngineError):
    """The engine aborted the request before it could answer (``abort_all`` while the
    server stops); raised where an answer cannot be partial (an embedding)."""

    status = 503
    type = "service_unavailable"

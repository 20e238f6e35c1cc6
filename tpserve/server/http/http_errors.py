"""The error envelopes (OpenAI's; Anthropic's under ``/v1/messages``) and the exception
handlers that produce them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpserve.server.engine.errors import EngineError, EngineOverloadedError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; nobody reads it

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def error_type_for(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "internal_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PATH = "/v1/messages"  # it and the paths below it answer errors as Anthropic does

_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPE_BY_STATUS.get(
        status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error envelope (the body of an error answer, and the ``error`` event)."""
    return {"type": "error",
            "error": {"type": anthropic_error_type(status), "message": message}}


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the router matches (Starlette's rule): under a ``root_path`` (``--root-path``)
    a request may name the prefix or not, and ``/api/v1/models`` is ``/v1/models``."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


class APIError(Exception):
    """An error to send to the client in OpenAI's envelope."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, param=param)

    @classmethod
    def from_engine(cls, exc: EngineError) -> APIError:
        headers = {}
        if isinstance(exc, EngineOverloadedError):
            headers["Retry-After"] = str(max(0, int(exc.retry_after)))
        message = str(exc) or type(exc).__name__
        return cls(exc.status, message, type=exc.type, headers=headers)

    def body(self, path: str = "") -> dict[str, Any]:
        """The envelope of the endpoint at ``path``: Anthropic's under ``/v1/messages``,
        OpenAI's elsewhere."""
        if speaks_anthropic(path):
            return anthropic_error_body(self.status, self.message)
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: object) -> bool:
    """pydantic names union members in ``loc`` (``str``, ``list[int]``, a model's class)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part
                                      or part[:1].isupper())


def _loc_str(loc: Sequence[Any]) -> str:
    parts = [str(p) for i, p in enumerate(loc)
             if not (i == 0 and p == "body") and not _is_union_tag(p)]
    return ".".join(parts)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """One 400 from pydantic's error list: every problem in the message, the first as param."""
    messages, first_param = [], None
    for err in errors:
        where = _loc_str(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            messages.append(f"invalid JSON body: {detail}".rstrip(": "))
            continue
        if first_param is None and where:
            first_param = where
        messages.append(f"{where or 'request body'}: {err.get('msg')}")
    unique = dict.fromkeys(messages)  # union members repeat the same complaint
    return APIError.bad_request("; ".join(unique) or "invalid request", param=first_param)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response(route_path(request.scope))


async def _on_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response(route_path(request.scope))


async def _on_engine_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EngineError)
    if exc.status >= 500 and exc.status != 503:
        logger.error("engine error: %s", exc, exc_info=exc)
    return APIError.from_engine(exc).response(route_path(request.scope))


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    # a body over the limit found while read (chunked): the code its Content-Length gets
    code = "request_too_large" if exc.status_code == 413 else None
    return APIError(exc.status_code, message, headers=exc.headers, code=code).response(
        route_path(request.scope))


async def _on_disconnect(_: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def install_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(EngineError, _on_engine_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ClientDisconnected, _on_disconnect)

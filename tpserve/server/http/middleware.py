"""ASGI middlewares: API-key check, request-body size limit, last-resort 500 envelope."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Sequence

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.server.http.http_errors import APIError, route_path

logger = logging.getLogger(__name__)


async def send_error(scope: Scope, send: Send, status: int, message: str, *,
                     code: str | None = None, headers: dict[str, str] | None = None) -> None:
    """An error answer in the envelope of the endpoint ``scope`` names."""
    body = json.dumps(APIError(status, message, code=code).body(route_path(scope))).encode()
    raw_headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the paths ``protected(path)`` selects,
    or ``x-api-key: <key>`` (how the anthropic client sends its key); ``api_key`` is one
    key or several (vLLM's ``--api-key k1 k2``), any of which is accepted."""

    def __init__(self, app: ASGIApp, *, api_key: str | Sequence[str],
                 protected: Callable[[str], bool]):
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.expected = tuple(k.encode() for k in keys)
        self.protected = protected

    def _matches(self, token: bytes) -> bool:
        # every key compared, in constant time each: the time taken tells no key apart
        found = False
        for key in self.expected:
            found |= hmac.compare_digest(token, key)
        return found

    def _authorized(self, scope: Scope) -> bool:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and self._matches(token.strip()):
            return True
        key = _header(scope, b"x-api-key")
        return key is not None and self._matches(key.strip())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protected(route_path(scope)):
            return await self.app(scope, receive, send)
        if self._authorized(scope):
            return await self.app(scope, receive, send)
        await send_error(scope, send, 401, "Invalid or missing API key (expected "
                         "'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class BodyLimitMiddleware:
    """Answers 413 when a request body is, or turns out while read to be, over ``max_bytes``."""

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: int) -> str:
        return f"Request body of {size} bytes exceeds the limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await send_error(scope, send, 400, "Invalid Content-Length header")
            if size > self.max_bytes:
                return await send_error(scope, send, 413, self._too_large(size),
                                        code="request_too_large")
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self._too_large(received))
            return message

        await self.app(scope, counting_receive, send)


class CatchAllMiddleware:
    """Turns an unhandled exception into a logged 500 in the envelope (if nothing was sent)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error serving %s %s", scope.get("method"), scope["path"])
            if started:
                raise
            await send_error(scope, send, 500, "Internal server error", code="internal_error")

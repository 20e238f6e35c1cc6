"""One access-log line per HTTP request (uvicorn's own access log is off):

    POST /v1/chat/completions 200 prompt_tokens=12 completion_tokens=8 latency_ms=153.2

written when the response has been sent in full (a stream: at its end). Token counts are
those of the engine request the route ran (``-`` for routes that run none, or a request
that ended before the engine finished it). ``--disable-log-requests`` leaves this
middleware out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("tpserve.access")

SCOPE_KEY = "tpserve.access"


@dataclass
class AccessRecord:
    """What the route tells the access log: the finished request's token counts."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def access_record(request: Request) -> AccessRecord:
    """The record of this request (a detached one when the access log is off)."""
    return request.scope.get(SCOPE_KEY) or AccessRecord()


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        record = scope[SCOPE_KEY] = AccessRecord()
        status = 500  # unless a response starts

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            logger.info("%s %s %d prompt_tokens=%s completion_tokens=%s latency_ms=%.1f",
                        scope.get("method"), scope["path"], status,
                        _count(record.prompt_tokens), _count(record.completion_tokens),
                        (time.monotonic() - start) * 1000.0)


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)

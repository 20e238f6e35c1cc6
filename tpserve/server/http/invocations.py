"""Amazon SageMaker's inference route, as vLLM serves it: ``POST /invocations`` answers a
JSON body as the route its fields name (its health check, ``/ping``, is ``/health``'s
handler in ``routes_extra.py``).

Which route (``invocation_path``; the first rule that matches):
- ``query`` and ``documents``: ``/rerank``; ``text_1``, ``data_1`` or ``queries`` (the
  score request's forms): ``/score``;
- ``messages``: chat completions, or on a pooling server ``/v1/embeddings`` (an embedder)
  or ``/classify`` (a sequence classifier);
- ``prompt``: completions;
- ``input``: ``/v1/embeddings`` or ``/classify`` on a pooling server, else the Responses API.

``InvocationsMiddleware`` hands the request on under that route's path, body, headers and
all, so it is validated, answered (streams too), counted and refused exactly as a request
to that route is; the access log keeps ``/invocations``. A body that names no route (or is
not a JSON object) reaches the ``/invocations`` route itself, which refuses it with 400.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpserve.model.pooling import PoolerConfig
from tpserve.server.http.http_errors import APIError, route_path
from tpserve.server.http.middleware import send_error
from tpserve.server.http.replies import ERROR_RESPONSES

PATH = "/invocations"
KINDS = ("`messages` (chat completions), `prompt` (completions), `input` (embeddings, "
         "classification or responses), `query` and `documents` (rerank) or `text_1`, "
         "`data_1` or `queries` (score)")


def invocation_path(body: Any, pooler: PoolerConfig | None) -> str | None:
    """The route that answers ``body`` (see the module docstring), or None."""
    if not isinstance(body, dict):
        return None
    pooled = None if pooler is None else "/classify" if pooler.classifies else "/v1/embeddings"
    if "query" in body and "documents" in body:
        return "/rerank"
    if any(key in body for key in ("text_1", "data_1", "queries")):
        return "/score"
    if "messages" in body:
        return pooled or "/v1/chat/completions"
    if "prompt" in body:
        return "/v1/completions"
    if "input" in body:
        return pooled or "/v1/responses"
    return None


class InvocationsMiddleware:
    """Re-routes ``POST /invocations`` to ``invocation_path``'s route (module docstring);
    the body is read whole (inside the body-size limit) and handed on unchanged, and the
    client's later messages (a disconnect) still reach the route."""

    def __init__(self, app: ASGIApp, *, pooler: PoolerConfig | None):
        self.app = app
        self.pooler = pooler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                route_path(scope) != PATH:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            try:
                message = await receive()
            except StarletteHTTPException as e:  # over the body limit, found while read
                await send_error(scope, send, e.status_code, e.detail,
                                 code="request_too_large" if e.status_code == 413 else None)
                return
            if message["type"] != "http.request":  # the client left before its body ended
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            target = invocation_path(json.loads(body), self.pooler)
        except ValueError:
            target = None
        if target is not None:
            path = scope["path"][:-len(PATH)] + target
            scope = dict(scope, path=path, raw_path=path.encode())
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def make_invocations_router() -> APIRouter:
    router = APIRouter(tags=["sagemaker"])

    @router.post(PATH, responses=ERROR_RESPONSES)
    async def invocations(body: dict[str, Any]) -> Response:
        """SageMaker's inference route: a body is answered by the route its fields name
        (``InvocationsMiddleware``); one that names none ends here."""
        raise APIError.bad_request(
            f"/invocations could not tell which API the body is for: it needs {KINDS}; "
            f"it has {', '.join(f'`{k}`' for k in sorted(body)) or 'no fields'}")

    return router

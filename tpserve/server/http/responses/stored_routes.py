"""The routes of stored responses (``store.py``): ``GET`` and ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``, as OpenAI's API answers
them; 404 for a response not held, or on a server that keeps none."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.replies import ERROR_RESPONSES
from tpserve.server.http.responses.store import ResponseStore
from tpserve.server.http.state import get_state


def _store(request: Request, response_id: str) -> ResponseStore:
    """The server's response store; 404 for ``response_id`` when it keeps none."""
    store = get_state(request).responses
    if store is None:
        raise APIError(404, f"Response with id '{response_id}' not found: this server "
                       "stores no responses (--responses-store-size)")
    return store


def make_stored_responses_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    @router.get("/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        """A stored response."""
        return _store(request, response_id).get(response_id).response

    @router.delete("/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        _store(request, response_id).delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
    async def response_input_items(response_id: str, request: Request,
                                   order: Literal["asc", "desc"] = "desc",
                                   limit: int = Query(20, ge=1, le=100),
                                   after: str | None = None) -> dict[str, Any]:
        """The items a stored response was answered from, a page of them (newest first
        by default, as OpenAI's API lists them)."""
        items = list(_store(request, response_id).get(response_id).inputs)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError.bad_request(f"no input item {after!r} in response "
                                           f"{response_id}", "after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > limit}

    return router

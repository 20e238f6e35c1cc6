"""``/tokenize``, ``/detokenize`` (vLLM's shapes), ``/health`` (and SageMaker's ``/ping``),
``/metrics``, ``/memory``, ``/memory/snapshot``, ``/version``, vLLM's ``/load``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import tpserve
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import (
    DetokenizeRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from tpserve.server.http.replies import (
    DetokenizeResponse,
    ErrorResponse,
    TokenizeResponse,
    VersionResponse,
)
from tpserve.server.http.state import get_state
from tpserve.server.http.tools import template_tools

TOKENIZER_ERRORS: dict[int | str, dict] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413)}


def make_extra_router() -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse, responses=TOKENIZER_ERRORS,
                 tags=["tokenizer"])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        state = get_state(request)
        state.resolve_model(body.model)
        if isinstance(body, TokenizeCompletionRequest):
            ids = await state.prompts.encode(body.prompt, body.add_special_tokens)
        else:
            ids = await state.prompts.chat_ids(body.messages, body,
                                               add_special_tokens=body.add_special_tokens,
                                               tools=template_tools(body))
        strs = await state.prompts.token_strs(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len,
                                tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=TOKENIZER_ERRORS,
                 tags=["tokenizer"])
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        state = get_state(request)
        state.resolve_model(body.model)
        return DetokenizeResponse(prompt=await state.prompts.decode(body.tokens))

    @router.get("/health", tags=["server"], responses={503: {"model": ErrorResponse}})
    @router.get("/ping", tags=["sagemaker"], responses={503: {"model": ErrorResponse}})
    @router.post("/ping", tags=["sagemaker"], responses={503: {"model": ErrorResponse}})
    async def health(request: Request) -> Response:
        """200 while the engine is healthy and accepting requests, else 503 (``/ping``:
        SageMaker's health check, GET or POST, as vLLM answers it)."""
        engine = get_state(request).engine
        if engine.dead_reason is not None:
            raise APIError(503, f"engine is dead: {engine.dead_reason}")
        if not engine.accepting:
            raise APIError(503, "server is shutting down")
        try:
            healthy = engine.is_healthy()
        except Exception as exc:
            raise APIError(503, f"engine health check failed: {exc}") from exc
        if not healthy:
            raise APIError(503, "engine is unhealthy")
        return Response(status_code=200)

    @router.get("/load", tags=["server"])
    async def load(request: Request) -> dict[str, int]:
        """vLLM's server load: the requests running the model now (``frontend.LoadCounter``;
        always counted, as with vLLM's ``--enable-server-load-tracking``)."""
        return {"server_load": get_state(request).load.in_flight}

    @router.get("/metrics", tags=["server"], response_class=Response,
                responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request) -> Response:
        m = get_state(request).metrics
        return Response(m.render(), media_type=m.content_type)

    @router.get("/memory", tags=["server"],
                responses={503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}})
    async def memory(request: Request, fresh: bool = False) -> dict[str, Any]:
        """The memory report (``server/engine/memory_monitor.py``): every rank's start-up
        plan by component, live allocator figures, rank 0's recent KV usage and
        fragmentation; what ``tpserve memory`` draws. ``fresh=true``: every rank's
        allocator is read now, between steps (an engine query), instead of the last
        sample (rank 0's at most a few seconds old, the others' at most
        ``rank_interval_s``)."""
        engine = get_state(request).engine
        if fresh:
            return await engine.query("memory_report")
        report = engine.stats().get("memory")
        if report is None:
            raise APIError(503, "the engine has not reported its memory yet")
        return report

    @router.get("/memory/snapshot", tags=["server"], response_class=Response,
                responses={200: {"content": {"application/octet-stream": {}}},
                           **{s: {"model": ErrorResponse} for s in (400, 401, 503, 504)}})
    async def memory_snapshot(request: Request, replica: int = 0) -> Response:
        """Rank 0's caching-allocator snapshot (segments and the events recorded since
        start-up) as the pickle https://pytorch.org/memory_viz reads; with
        ``--data-parallel-size``, that of replica ``replica``'s rank 0 (400 when there is
        no such replica). Needs ``--memory-history`` (else 400 saying so); taken between
        steps."""
        if replica < 0:
            raise APIError(400, f"replica {replica}: replicas are numbered from 0",
                           param="replica")
        data = await get_state(request).engine.query(("memory_snapshot", replica))
        name = "memory-snapshot" if replica == 0 else f"memory-snapshot-replica{replica}"
        return Response(data, media_type="application/octet-stream", headers={
            "Content-Disposition": f'attachment; filename="{name}.pickle"'})

    @router.get("/version", tags=["server"], response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=tpserve.__version__)

    return router

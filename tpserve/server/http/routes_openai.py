"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.access_log import access_record
from tpserve.server.http.generation import engine_outputs, unless_disconnected
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.metrics import RequestTracker
from tpserve.server.http.openai_format import (
    OutputAccumulator,
    ResponseContext,
    chat_response,
    completion_response,
)
from tpserve.server.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
)
from tpserve.server.http.request_params import build_sampling_params
from tpserve.server.http.state import ServerState, get_state
from tpserve.server.http.streaming import SSEResponse, chat_events, completion_events

ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
STREAM_RESPONSE: dict[int | str, dict] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


async def _collect(first: RequestOutput, rest: AsyncIterator[RequestOutput], n: int
                   ) -> OutputAccumulator:
    acc = OutputAccumulator(n)
    acc.add(first)
    async for out in rest:
        acc.add(out)
    return acc


async def _serve(request: Request, state: ServerState, body: SamplingRequest, prefix: str,
                 prompt_ids: list[int], params: SamplingParams, model: str,
                 tracker: RequestTracker) -> Response:
    """Runs the request on the engine and answers it, streamed or whole."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    ctx = ResponseContext(id=request_id, created=int(time.time()), model=model, n=params.n,
                          logprobs=params.logprobs is not None,
                          include_usage=body.include_usage)
    outputs = engine_outputs(state.engine, request_id, prompt_ids, params, tracker,
                             access_record(request))
    handed_over = False
    try:
        # The first output is awaited before answering, so that errors raised on submission
        # (overload, shutdown, dead engine) get their HTTP status even when streaming.
        first = await unless_disconnected(request, anext(outputs))
        is_chat = isinstance(body, ChatCompletionRequest)
        if body.stream:
            events = chat_events if is_chat else completion_events
            handed_over = True
            return SSEResponse(events(first, outputs, ctx))
        acc = await unless_disconnected(request, _collect(first, outputs, params.n))
        result = chat_response(acc, ctx) if is_chat else completion_response(acc, ctx)
        return JSONResponse(result.model_dump())
    finally:
        if not handed_over:
            await outputs.aclose()


def make_openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["openai"])

    @router.get("/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(request: Request) -> ModelList:
        state = get_state(request)
        return ModelList(data=[
            ModelCard(id=name, created=state.created, root=state.engine.model_name,
                      max_model_len=state.engine.max_model_len,
                      default_sampling_params=state.default_sampling_params)
            for name in state.served_model_names])

    @router.post("/completions", response_model=CompletionResponse,
                 responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        state = get_state(request)
        tracker = state.metrics.track()  # latencies count from here
        model = state.resolve_model(body.model)
        if body.echo:
            raise APIError.bad_request("echo is not supported", "echo")
        state.check_available()
        prompt_ids = await state.prompts.completion_ids(body.prompt)
        params = build_sampling_params(body, len(prompt_ids), state.engine.max_model_len,
                                       state.default_sampling_params)
        return await _serve(request, state, body, "cmpl", prompt_ids, params, model, tracker)

    @router.post("/chat/completions", response_model=ChatCompletionResponse,
                 responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        state = get_state(request)
        tracker = state.metrics.track()
        model = state.resolve_model(body.model)
        state.check_available()
        prompt_ids = await state.prompts.chat_ids(body.messages, add_generation_prompt=True)
        params = build_sampling_params(body, len(prompt_ids), state.engine.max_model_len,
                                       state.default_sampling_params)
        return await _serve(request, state, body, "chatcmpl", prompt_ids, params, model, tracker)

    return router

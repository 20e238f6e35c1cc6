"""``/v1/embeddings`` (OpenAI's, with vLLM's extensions) on a ``--runner pooling`` server.

Each input (a string, a list of token ids, or a list of either; or vLLM's chat
``messages``) runs as its own engine request, all concurrently; the answer lists one
embedding per input, in order, as floats or as base64 of little-endian float32 (what the
``openai`` client asks for by default and decodes). An error on any input ends the whole
request with it, and the other inputs' engine requests are aborted.
"""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
import uuid
from collections.abc import Callable
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tpserve.model.pooling import PoolerConfig
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.server.engine.errors import RequestAbortedError
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.access_log import access_record
from tpserve.server.http.generation import engine_outputs, unless_disconnected
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.metrics import RequestTracker
from tpserve.server.http.protocol import ChatMessage, ChatTemplateOptions, RequestModel, TokenIds
from tpserve.server.http.replies import UsageInfo
from tpserve.server.http.request_params import truncated_prompt
from tpserve.server.http.state import ServerState
from tpserve.server.http.unsupported import VLLM_REFUSED, refuse_fields, warn_unknown_fields


class EmbeddingRequest(RequestModel, ChatTemplateOptions):
    """OpenAI's embeddings request plus vLLM's: ``input`` or chat ``messages`` (rendered
    by the chat template, without a generation prompt unless asked), ``truncate_prompt_tokens``,
    ``add_special_tokens`` (default: true for ``input``, false for ``messages``, as vLLM),
    ``normalize`` (default: the server's pooler; vLLM's newer ``use_activation``, and its
    older ``activation``, say the same), ``priority``, ``cache_salt``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | TokenIds | list[str] | list[TokenIds] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    add_special_tokens: bool | None = None
    normalize: bool | None = None
    use_activation: bool | None = None  # vLLM's name for normalize
    activation: bool | None = None  # vLLM's older name for use_activation
    priority: int | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only within one salt
    # vLLM's base64 encodings: only float32 in this machine's (little-endian) byte order
    embed_dtype: str | None = None
    endianness: str | None = None
    add_generation_prompt: bool = False


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def pooler_of(state: ServerState, api: str) -> PoolerConfig:
    """The server's pooler; 400 on a generative server, naming the flag that pools."""
    if state.pooler is None:
        raise APIError.bad_request(
            f"this server runs a generative model, which does not answer the {api} API; "
            "serve an embedding model with --runner pooling", "model")
    return state.pooler


def requested_activation(body: RequestModel, names: tuple[str, ...]) -> bool | None:
    """Whether the request asks for the pooler's activation (an embedding's normalization,
    a classifier's sigmoid or softmax) by any of the fields ``names`` (vLLM's
    ``use_activation`` and the older names it still reads), None when none is given; 400
    when two of them disagree."""
    given = [(n, getattr(body, n)) for n in names if getattr(body, n, None) is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise APIError.bad_request(f"{given[0][0]} and {name} disagree; give one of them",
                                       name)
    return given[0][1] if given else None


def pooling_request(pooling: PoolingParams, body: RequestModel) -> SamplingParams:
    """A pooling engine request's parameters: ``pooling``, and the request's ``priority``
    and ``cache_salt`` (400 for an empty salt, as the generation routes answer)."""
    try:
        return SamplingParams(pooling=pooling, priority=getattr(body, "priority", None) or 0,
                              cache_salt=getattr(body, "cache_salt", None))
    except ValueError as exc:
        message = str(exc)
        raise APIError.bad_request(message, message.split(" ", 1)[0]) from exc


def check_inputs(body: EmbeddingRequest) -> None:
    """400 unless exactly one of ``input`` and ``messages`` is given, and the chat
    template's options only with ``messages``."""
    if (body.input is None) == (body.messages is None):
        raise APIError.bad_request("give exactly one of input and messages",
                                   "input" if body.input is None else "messages")
    if body.input is not None:  # the chat template's options mean nothing without messages
        for name in ("chat_template", "chat_template_kwargs", "documents"):
            if getattr(body, name) is not None:
                raise APIError.bad_request(f"{name} applies to messages, not to input", name)
        for name in ("add_generation_prompt", "continue_final_message"):
            if getattr(body, name):
                raise APIError.bad_request(f"{name} applies to messages, not to input", name)


def check_fields(body: EmbeddingRequest, state: ServerState) -> PoolingParams:
    """400 for what this server cannot answer; the request's pooling parameters."""
    pooler = pooler_of(state, "Embeddings")
    if pooler.classifies:
        raise APIError.bad_request(
            "this server runs a sequence classifier: it answers /classify, /score and "
            "/rerank, not embeddings", "model")
    check_inputs(body)
    if body.embed_dtype not in (None, "float32"):
        raise APIError.bad_request(f"embed_dtype {body.embed_dtype!r} is not supported: "
                                   "embeddings are float32", "embed_dtype")
    if body.endianness not in (None, "native", sys.byteorder):
        raise APIError.bad_request(f"endianness {body.endianness!r} is not supported: "
                                   f"base64 embeddings are {sys.byteorder}-endian", "endianness")
    refused = {} if state.priority_scheduling else {"priority": VLLM_REFUSED["priority"]}
    refuse_fields(body, refused)
    why = pooler.check_dimensions(body.dimensions)
    if why is not None:
        raise APIError.bad_request(why, "dimensions")
    asked = requested_activation(body, ("normalize", "use_activation", "activation"))
    normalize = pooler.normalize if asked is None else asked
    return PoolingParams(pooler.pooling_type, normalize, body.dimensions)


async def input_ids(body: EmbeddingRequest, state: ServerState) -> list[list[int]]:
    """Each input's token ids (truncated as ``truncate_prompt_tokens`` asks); 400 for an
    empty input or one over the model's context."""
    if body.messages is not None:
        if not body.messages:
            raise APIError.bad_request("messages must not be empty", "messages")
        prompts = [await state.prompts.chat_ids(body.messages, body,
                                                add_special_tokens=bool(body.add_special_tokens))]
    else:
        raw = body.input
        if isinstance(raw, list) and not raw:
            raise APIError.bad_request("input must not be empty", "input")
        items = raw if isinstance(raw, list) and isinstance(raw[0], str | list) else [raw]
        special = body.add_special_tokens is not False
        prompts = []
        for i, item in enumerate(items):
            where = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                ids = await state.prompts.encode(item, add_special_tokens=special)
            else:
                ids = list(item)
                state.prompts.check_ids(ids, where)
            if not ids:
                raise APIError.bad_request("an input must not be empty", where)
            prompts.append(ids)
    def param(i: int) -> str:
        if body.messages is not None:
            return "messages"
        return "input" if len(prompts) == 1 else f"input.{i}"

    return fit_to_context(prompts, body.truncate_prompt_tokens, body.truncation_side, state,
                          param)


def fit_to_context(prompts: list[list[int]], truncate: int | None, side: str | None,
                   state: ServerState, param: Callable[[int], str]) -> list[list[int]]:
    """Each input truncated as ``truncate_prompt_tokens`` and ``truncation_side`` ask; 400
    (naming ``param(i)``) for one still over the model's context."""
    limit = state.engine.max_model_len
    prompts = [truncated_prompt(ids, truncate, limit, side) for ids in prompts]
    for i, ids in enumerate(prompts):
        if len(ids) > limit:
            raise APIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input (or set truncate_prompt_tokens).", param(i))
    return prompts


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(array.array("f", vector).tobytes()).decode("ascii")


async def create_embeddings(body: EmbeddingRequest, request: Request,
                            state: ServerState) -> JSONResponse:
    tracker = state.metrics.track()
    model = state.resolve_model(body.model)
    warn_unknown_fields(body, state.warned_fields)
    params = pooling_request(check_fields(body, state), body)
    state.check_available()
    prompts = await input_ids(body, state)
    request_id = f"embd-{uuid.uuid4().hex}"
    outs = await embed_all(request, state, prompts, params, request_id, tracker)
    used = sum(o.num_prompt_tokens for o in outs)
    response = EmbeddingResponse(
        id=request_id, created=int(time.time()), model=model,
        data=[EmbeddingData(index=k, embedding=encode(o.embedding, body.encoding_format))
              for k, o in enumerate(outs)],
        usage=UsageInfo(prompt_tokens=used, completion_tokens=0, total_tokens=used))
    return JSONResponse(response.model_dump())


async def embed_all(request: Request, state: ServerState, prompts: list[list[int]],
                    params: SamplingParams, request_id: str, tracker: RequestTracker
                    ) -> list[RequestOutput]:
    """Every prompt's finished output (with its embedding), each its own engine request
    ``{request_id}-{k}``, all at once; the first error (or the client leaving) aborts the
    rest. Their prompt tokens go into the access log's record."""
    record = access_record(request)

    async def one(k: int, ids: list[int]) -> RequestOutput:
        last = None
        async for out in engine_outputs(state.engine, f"{request_id}-{k}", ids, params,
                                        tracker if k == 0 else state.metrics.track(),
                                        record, state.frontend.request_log):
            last = out
        if last is None or last.embedding is None:  # aborted: no partial embedding
            raise RequestAbortedError("the server aborted the request before its embedding "
                                      "was computed")
        return last

    return await unless_disconnected(request, _all_or_none(
        [one(k, ids) for k, ids in enumerate(prompts)]))


async def _all_or_none(work: list) -> list[RequestOutput]:
    """Every coroutine's result, in order; the first to raise cancels the others (which
    closes, and so aborts, their engine requests), and its error is raised once they have
    cleaned up; a cancellation of this one cancels them all the same way."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled()
                       and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""vLLM's ``/classify`` on a sequence classifier's server (a ``*ForSequenceClassification``
checkpoint, ``--runner pooling``): each input's label probabilities (sigmoid for one label,
softmax over several: ``model.pooling.finish_classification``), its most probable label
and the number of classes.

``input`` is a string, a list of token ids, or a list of either, or vLLM's chat
``messages``; each input runs as its own engine request, all concurrently
(``embeddings.embed_all``), and the answer lists them in order.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tpserve.model.pooling import PoolerConfig
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.server.http.embeddings import check_inputs, embed_all, input_ids, pooler_of
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatMessage, ChatTemplateOptions, RequestModel, TokenIds
from tpserve.server.http.replies import UsageInfo
from tpserve.server.http.state import ServerState
from tpserve.server.http.unsupported import VLLM_REFUSED, refuse_fields, warn_unknown_fields


class ClassificationRequest(RequestModel, ChatTemplateOptions):
    """vLLM's classification request: ``input`` or chat ``messages``, with
    ``truncate_prompt_tokens``, ``add_special_tokens`` (default: true for ``input``, false
    for ``messages``) and ``priority``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | TokenIds | list[str] | list[TokenIds] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    add_special_tokens: bool | None = None
    priority: int | None = None
    add_generation_prompt: bool = False


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


def classifier_of(state: ServerState, api: str) -> PoolerConfig:
    """The server's pooler when it classifies; 400 otherwise, saying what to serve."""
    pooler = pooler_of(state, api)
    if not pooler.classifies:
        raise APIError.bad_request(
            f"this server runs an embedding model, which does not answer the {api} API; "
            "serve a *ForSequenceClassification checkpoint", "model")
    return pooler


def classification_params(pooler: PoolerConfig, priority: int | None) -> SamplingParams:
    """A classifier's engine request: pooled as the server pools, nothing sampled."""
    return SamplingParams(pooling=PoolingParams(pooler.pooling_type, False),
                          priority=priority or 0)


async def create_classification(body: ClassificationRequest, request: Request,
                                state: ServerState) -> JSONResponse:
    tracker = state.metrics.track()
    model = state.resolve_model(body.model)
    warn_unknown_fields(body, state.warned_fields)
    pooler = classifier_of(state, "Classification")
    check_inputs(body)
    refuse_fields(body, {} if state.priority_scheduling
                  else {"priority": VLLM_REFUSED["priority"]})
    state.check_available()
    prompts = await input_ids(body, state)
    request_id = f"classify-{uuid.uuid4().hex}"
    outs = await embed_all(request, state, prompts,
                           classification_params(pooler, body.priority), request_id, tracker)
    used = sum(o.num_prompt_tokens for o in outs)
    data = []
    for k, o in enumerate(outs):
        probs = o.embedding
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=k, label=pooler.labels[best], probs=probs,
                                       num_classes=len(probs)))
    return JSONResponse(ClassificationResponse(
        id=request_id, created=int(time.time()), model=model, data=data,
        usage=UsageInfo(prompt_tokens=used, completion_tokens=0, total_tokens=used),
    ).model_dump())

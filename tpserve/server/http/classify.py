"""vLLM's ``/classify`` on a sequence classifier's server (a ``*ForSequenceClassification``
checkpoint, ``--runner pooling``): each input's label scores (vLLM's activation of the
logits, by the config's ``problem_type``: the raw score of a regressor, each label's sigmoid
for a multi-label classifier, else sigmoid for one label and softmax over several:
``model.pooling.classification_scores``; the logits with ``use_activation: false``), its
best label and the number of classes.

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

from tpserve.model.pooling import PoolerConfig, classification_scores
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.server.http.embeddings import (
    check_inputs,
    embed_all,
    input_ids,
    pooler_of,
    pooling_request,
    requested_activation,
)
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatMessage, ChatTemplateOptions, RequestModel, TokenIds
from tpserve.server.http.replies import UsageInfo
from tpserve.server.http.state import ServerState
from tpserve.server.http.unsupported import VLLM_REFUSED, refuse_fields, warn_unknown_fields


class ClassificationRequest(RequestModel, ChatTemplateOptions):
    """vLLM's classification request: ``input`` or chat ``messages``, with
    ``truncate_prompt_tokens``, ``add_special_tokens`` (default: true for ``input``, false
    for ``messages``), ``priority``, ``cache_salt`` and ``use_activation`` (false: the
    logits; ``activation``: its older name)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | TokenIds | list[str] | list[TokenIds] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    add_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only within one salt
    use_activation: bool | None = None  # false: the logits
    activation: bool | None = None  # vLLM's older name for use_activation
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


def classification_params(pooler: PoolerConfig, body: RequestModel) -> SamplingParams:
    """A classifier's engine request (its answer: the logits): pooled as the server pools,
    nothing sampled; the request's priority and cache salt."""
    return pooling_request(PoolingParams(pooler.pooling_type, False), body)


async def create_classification(body: ClassificationRequest, request: Request,
                                state: ServerState) -> JSONResponse:
    tracker = state.metrics.track()
    model = state.resolve_model(body.model)
    warn_unknown_fields(body, state.warned_fields)
    pooler = classifier_of(state, "Classification")
    check_inputs(body)
    refuse_fields(body, {} if state.priority_scheduling
                  else {"priority": VLLM_REFUSED["priority"]})
    activate = requested_activation(body, ("use_activation", "activation")) is not False
    params = classification_params(pooler, body)
    state.check_available()
    prompts = await input_ids(body, state)
    request_id = f"classify-{uuid.uuid4().hex}"
    outs = await embed_all(request, state, prompts, params, request_id, tracker)
    used = sum(o.num_prompt_tokens for o in outs)
    data = []
    for k, o in enumerate(outs):
        probs = classification_scores(o.embedding, pooler.activation) if activate \
            else o.embedding
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=k, label=pooler.labels[best], probs=probs,
                                       num_classes=len(probs)))
    return JSONResponse(ClassificationResponse(
        id=request_id, created=int(time.time()), model=model, data=data,
        usage=UsageInfo(prompt_tokens=used, completion_tokens=0, total_tokens=used),
    ).model_dump())

"""vLLM's score and rerank APIs on a ``--runner pooling`` server: on an embedding model a
pair's score is the cosine similarity of its two texts' embeddings; on a sequence
classifier of one label (a cross-encoder reranker) it is the classifier's sigmoid over the
pair tokenized as one input (``Prompts.encode_pair``), as vLLM scores with each. The
server's ``/classify`` (``classify.py``) is routed here too.

- ``/score``, ``/v1/score``: ``text_1`` and ``text_2`` (a string or a list each): one
  ``text_1`` against every ``text_2``, or the two lists pairwise; one score per pair, in
  order.
- ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's shape): a ``query``
  against ``documents``, the ``top_n`` best first, each with its index and text.

Every distinct text is embedded once (every pair cross-encoded once), as its own engine
request (``embeddings.embed_all``); the usage counts those inputs' tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tpserve.model.pooling import PoolerConfig
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.server.http.classify import (
    ClassificationRequest,
    ClassificationResponse,
    classification_params,
    create_classification,
)
from tpserve.server.http.embeddings import embed_all, fit_to_context, pooler_of
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import RequestModel
from tpserve.server.http.replies import ERROR_RESPONSES, UsageInfo
from tpserve.server.http.state import ServerState, get_state
from tpserve.server.http.unsupported import VLLM_REFUSED, refuse_fields, warn_unknown_fields


class ScoreRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    priority: int | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, description="the best n; 0: every document")
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    priority: int | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against every ``text_2``, or two lists pairwise; 400
    for empty lists or lists of different lengths."""
    left = [text_1] if isinstance(text_1, str) else text_1
    right = [text_2] if isinstance(text_2, str) else text_2
    for name, texts in (("text_1", left), ("text_2", right)):
        if not texts:
            raise APIError.bad_request(f"{name} must not be empty", name)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError.bad_request(
            f"text_1 ({len(left)} texts) and text_2 ({len(right)} texts) must have the same "
            "length, or text_1 a single text", "text_2")
    return list(zip(left, right, strict=True))


async def similarities(request: Request, state: ServerState, pairs: list[tuple[str, str]],
                       body: ScoreRequest | RerankRequest, names: tuple[str, str], api: str,
                       prefix: str) -> tuple[list[float], int]:
    """Each pair's cosine similarity and the tokens of the distinct texts embedded (a
    classifier's server: ``cross_scores``); ``names``: the request fields of a pair's first
    and second text (400s name them)."""
    pooler = pooler_of(state, api)
    refused = {} if state.priority_scheduling else {"priority": VLLM_REFUSED["priority"]}
    refuse_fields(body, refused)
    state.check_available()
    if pooler.classifies:
        return await cross_scores(request, state, pooler, pairs, body, names, prefix)
    field: dict[str, str] = {}  # each distinct text, in order, and the field it came from
    for pair in pairs:
        for text, name in zip(pair, names, strict=True):
            field.setdefault(text, name)
    texts = list(field)
    prompts = []
    for text in texts:
        ids = await state.prompts.encode(text, add_special_tokens=True)
        if not ids:
            raise APIError.bad_request("a text must not be empty", field[text])
        prompts.append(ids)
    prompts = fit_to_context(prompts, body.truncate_prompt_tokens, body.truncation_side, state,
                             lambda i: field[texts[i]])
    params = SamplingParams(pooling=PoolingParams(pooler.pooling_type, True),
                            priority=body.priority or 0)
    outs = await embed_all(request, state, prompts, params,
                           f"{prefix}-{uuid.uuid4().hex}", state.metrics.track())
    vectors = dict(zip(texts, (torch.tensor(o.embedding, dtype=torch.float64) for o in outs),
                       strict=True))
    scores = [float(vectors[a] @ vectors[b]) for a, b in pairs]  # unit vectors: the cosine
    return scores, sum(o.num_prompt_tokens for o in outs)


async def cross_scores(request: Request, state: ServerState, pooler: PoolerConfig,
                       pairs: list[tuple[str, str]], body: ScoreRequest | RerankRequest,
                       names: tuple[str, str], prefix: str) -> tuple[list[float], int]:
    """Each pair's score from a one-label classifier over the pair as one input (400 for a
    classifier of several labels, whose score would be ambiguous), and the tokens of the
    distinct pairs."""
    if len(pooler.labels) != 1:
        raise APIError.bad_request(
            f"scoring pairs needs a classifier of one label (a cross-encoder); this one has "
            f"{len(pooler.labels)}: use /classify", "model")
    distinct = list(dict.fromkeys(pairs))
    prompts = []
    for a, b in distinct:
        if not a or not b:
            raise APIError.bad_request("a text must not be empty", names[0] if not a else names[1])
        prompts.append(await state.prompts.encode_pair(a, b))
    prompts = fit_to_context(prompts, body.truncate_prompt_tokens, body.truncation_side, state,
                             lambda i: names[1])
    outs = await embed_all(request, state, prompts,
                           classification_params(pooler, body.priority),
                           f"{prefix}-{uuid.uuid4().hex}", state.metrics.track())
    scores = dict(zip(distinct, (o.embedding[0] for o in outs), strict=True))
    return [scores[p] for p in pairs], sum(o.num_prompt_tokens for o in outs)


def _served(body: ScoreRequest | RerankRequest, request: Request) -> tuple[ServerState, str]:
    """The app's state and the served name to answer with (404 for another model); unknown
    fields logged."""
    state = get_state(request)
    model = state.resolve_model(body.model)
    warn_unknown_fields(body, state.warned_fields)
    return state, model


def make_scores_router() -> APIRouter:
    router = APIRouter(tags=["pooling"])

    @router.post("/classify", response_model=ClassificationResponse,
                 responses=ERROR_RESPONSES)
    async def classify(body: ClassificationRequest, request: Request) -> JSONResponse:
        """vLLM's classification API, on a sequence classifier's server (classify.py)."""
        return await create_classification(body, request, get_state(request))

    @router.post("/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
    @router.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
    async def create_score(body: ScoreRequest, request: Request) -> JSONResponse:
        state, model = _served(body, request)
        pairs = score_pairs(body.text_1, body.text_2)
        scores, used = await similarities(request, state, pairs, body, ("text_1", "text_2"),
                                          "Score", "score")
        return JSONResponse(ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=used, completion_tokens=0, total_tokens=used),
        ).model_dump())

    @router.post("/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
    @router.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
    @router.post("/v2/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
    async def create_rerank(body: RerankRequest, request: Request) -> JSONResponse:
        state, model = _served(body, request)
        if not body.documents:
            raise APIError.bad_request("documents must not be empty", "documents")
        if body.top_n < 0:
            raise APIError.bad_request(f"top_n must be 0 (all) or more, got {body.top_n}",
                                       "top_n")
        scores, used = await similarities(
            request, state, [(body.query, d) for d in body.documents], body,
            ("query", "documents"), "Rerank", "rerank")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        top = order[:body.top_n or len(order)]
        return JSONResponse(RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=model, usage=RerankUsage(total_tokens=used),
            results=[RerankResult(index=i, document=RerankDocument(text=body.documents[i]),
                                  relevance_score=scores[i]) for i in top],
        ).model_dump())

    return router

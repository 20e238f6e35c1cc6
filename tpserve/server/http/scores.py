"""vLLM's score and rerank APIs on a ``--runner pooling`` server: on an embedding model a
pair's score is the cosine similarity of its two texts' embeddings; on a sequence
classifier of one label (a cross-encoder reranker) it is the sigmoid of the classifier's
logit over the pair tokenized as one input (``Prompts.encode_pair``; the logit itself with
``use_activation: false``), as vLLM scores with each. The server's ``/classify``
(``classify.py``) is routed here too.

- ``/score``, ``/v1/score``: ``text_1`` and ``text_2`` (a string or a list each; or vLLM's
  ``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``): one first text
  against every second one, or the two lists pairwise; one score per pair, in order.
- ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's shape): a ``query``
  against ``documents`` (one string or a list), the ``top_n`` best first, each with its
  index and text.

Both take vLLM's ``max_tokens_per_query`` / ``max_tokens_per_doc`` (each first / second
text cut to its first N tokens before pairing), ``cache_salt``, ``priority``,
``truncate_prompt_tokens``. Every distinct text is embedded once (every pair
cross-encoded once), as its own engine request (``embeddings.embed_all``); the usage
counts those inputs' tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tpserve.model.pooling import PoolerConfig, cross_encoder_score
from tpserve.model.sampling_params import PoolingParams, SamplingParams
from tpserve.server.http.classify import (
    ClassificationRequest,
    ClassificationResponse,
    classification_params,
    create_classification,
)
from tpserve.server.http.embeddings import (
    embed_all,
    fit_to_context,
    pooler_of,
    pooling_request,
    requested_activation,
)
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import RequestModel
from tpserve.server.http.replies import ERROR_RESPONSES, UsageInfo
from tpserve.server.http.state import ServerState, get_state
from tpserve.server.http.unsupported import VLLM_REFUSED, refuse_fields, warn_unknown_fields


class PoolingScoreOptions(RequestModel):
    """What vLLM's score and rerank requests share beside their texts."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first tokens
    priority: int | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only within one salt
    # false: a cross-encoder's raw logit (a cosine does not change); ``activation``: its
    # older name
    use_activation: bool | None = None
    activation: bool | None = None
    # vLLM's: each query's (text_1's) / document's (text_2's) first N tokens scored, the
    # rest cut off before pairing; 0 or None: all
    max_tokens_per_query: int | None = None
    max_tokens_per_doc: int | None = None


class ScoreRequest(PoolingScoreOptions):
    """vLLM's score request: its two sides as ``text_1`` and ``text_2``, or ``data_1`` and
    ``data_2``, or ``queries`` and ``documents`` (or ``items``); exactly one pair."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None


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


class RerankRequest(PoolingScoreOptions):
    query: str
    documents: str | list[str]  # one document or several, as vLLM takes them
    top_n: int = Field(default=0, description="the best n; 0: every document")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# vLLM's spellings of a score request's two sides
SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
               ("queries", "items"))


def score_sides(body: ScoreRequest) -> tuple[str, str]:
    """The two fields that hold the request's sides (``SCORE_SIDES``); 400 naming a field
    unless exactly one pair of them is given."""
    firsts = [n for n in ("text_1", "data_1", "queries") if getattr(body, n) is not None]
    seconds = [n for n in ("text_2", "data_2", "documents", "items")
               if getattr(body, n) is not None]
    pairs = ", ".join(f"{a} and {b}" for a, b in SCORE_SIDES)
    for given in (firsts, seconds):
        if len(given) > 1:
            raise APIError.bad_request(f"give one pair of {pairs}; got both {given[0]} and "
                                       f"{given[1]}", given[1])
    if not firsts or not seconds:
        known = firsts or seconds
        missing = ("text_1" if not known else
                   next(a if known[0] == b else b for a, b in SCORE_SIDES if known[0] in (a, b)))
        raise APIError.bad_request(f"{missing} is missing: give one pair of {pairs}", missing)
    if (firsts[0], seconds[0]) not in SCORE_SIDES:
        raise APIError.bad_request(f"{seconds[0]} does not go with {firsts[0]}: give one pair "
                                   f"of {pairs}", seconds[0])
    return firsts[0], seconds[0]


def score_pairs(text_1: str | list[str], text_2: str | list[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against every ``text_2``, or two lists pairwise; 400
    (naming the fields ``names``) for empty lists or lists of different lengths."""
    left = [text_1] if isinstance(text_1, str) else text_1
    right = [text_2] if isinstance(text_2, str) else text_2
    for name, texts in zip(names, (left, right), strict=True):
        if not texts:
            raise APIError.bad_request(f"{name} must not be empty", name)
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError.bad_request(
            f"{names[0]} ({len(left)} texts) and {names[1]} ({len(right)} texts) must have "
            f"the same length, or {names[0]} a single text", names[1])
    return list(zip(left, right, strict=True))


def token_limits(body: PoolingScoreOptions, state: ServerState) -> tuple[int, int]:
    """The request's ``max_tokens_per_query`` and ``max_tokens_per_doc`` (0: no limit);
    400 for one below 0 or not below the model's context, as vLLM checks them."""
    limits = []
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        value = getattr(body, name) or 0
        if value < 0:
            raise APIError.bad_request(f"{name} must be a non-negative integer", name)
        if value >= state.engine.max_model_len:
            raise APIError.bad_request(f"{name} ({value}) must be less than max_model_len "
                                       f"({state.engine.max_model_len})", name)
        limits.append(value)
    return limits[0], limits[1]


async def cut_pairs(state: ServerState, pairs: list[tuple[str, str]],
                    limits: tuple[int, int]) -> list[tuple[str, str]]:
    """Each pair's first text cut to ``limits[0]`` tokens and its second to ``limits[1]``
    (``max_tokens_per_query`` and ``max_tokens_per_doc``; 0: no cut)."""
    if not any(limits):
        return pairs
    sides = []
    for k, limit in enumerate(limits):
        distinct = list(dict.fromkeys(p[k] for p in pairs))
        sides.append(dict(zip(distinct, await state.prompts.first_tokens(distinct, limit),
                              strict=True)))
    return [(sides[0][a], sides[1][b]) for a, b in pairs]


async def similarities(request: Request, state: ServerState, pairs: list[tuple[str, str]],
                       body: PoolingScoreOptions, names: tuple[str, str], api: str,
                       prefix: str) -> tuple[list[float], int]:
    """Each pair's cosine similarity and the tokens of the distinct texts embedded (a
    classifier's server: ``cross_scores``); ``names``: the request fields of a pair's first
    and second text (400s name them). Each text is first cut to the request's
    ``max_tokens_per_query`` / ``max_tokens_per_doc``."""
    pooler = pooler_of(state, api)
    refused = {} if state.priority_scheduling else {"priority": VLLM_REFUSED["priority"]}
    refuse_fields(body, refused)
    limits = token_limits(body, state)
    # the activation (normalization) does not change a cosine: only checked here
    activate = requested_activation(body, ("use_activation", "activation")) is not False
    params = (classification_params(pooler, body) if pooler.classifies else
              pooling_request(PoolingParams(pooler.pooling_type, True), body))
    state.check_available()
    pairs = await cut_pairs(state, pairs, limits)
    if pooler.classifies:
        return await cross_scores(request, state, pooler, pairs, body, names, prefix, params,
                                  activate)
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
    outs = await embed_all(request, state, prompts, params,
                           f"{prefix}-{uuid.uuid4().hex}", state.metrics.track())
    vectors = dict(zip(texts, (torch.tensor(o.embedding, dtype=torch.float64) for o in outs),
                       strict=True))
    scores = [float(vectors[a] @ vectors[b]) for a, b in pairs]  # unit vectors: the cosine
    return scores, sum(o.num_prompt_tokens for o in outs)


async def cross_scores(request: Request, state: ServerState, pooler: PoolerConfig,
                       pairs: list[tuple[str, str]], body: PoolingScoreOptions,
                       names: tuple[str, str], prefix: str, params: SamplingParams,
                       activate: bool) -> tuple[list[float], int]:
    """Each pair's score from a one-label classifier over the pair as one input (400 for a
    classifier of several labels, whose score would be ambiguous): the sigmoid of its logit
    (``cross_encoder_score``, whatever the config's ``problem_type``), the logit itself
    unless ``activate``; and the tokens of the distinct pairs."""
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
    outs = await embed_all(request, state, prompts, params,
                           f"{prefix}-{uuid.uuid4().hex}", state.metrics.track())
    logits = (o.embedding[0] for o in outs)
    scores = dict(zip(distinct, (cross_encoder_score(x) if activate else x for x in logits),
                      strict=True))
    return [scores[p] for p in pairs], sum(o.num_prompt_tokens for o in outs)


def _served(body: PoolingScoreOptions, request: Request) -> tuple[ServerState, str]:
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
        names = score_sides(body)
        pairs = score_pairs(getattr(body, names[0]), getattr(body, names[1]), names)
        scores, used = await similarities(request, state, pairs, body, names, "Score",
                                          "score")
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
        documents = [body.documents] if isinstance(body.documents, str) else body.documents
        if not documents:
            raise APIError.bad_request("documents must not be empty", "documents")
        if body.top_n < 0:
            raise APIError.bad_request(f"top_n must be 0 (all) or more, got {body.top_n}",
                                       "top_n")
        scores, used = await similarities(
            request, state, [(body.query, d) for d in documents], body,
            ("query", "documents"), "Rerank", "rerank")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        top = order[:body.top_n or len(order)]
        return JSONResponse(RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=model,
            usage=RerankUsage(prompt_tokens=used, total_tokens=used),
            results=[RerankResult(index=i, document=RerankDocument(text=documents[i]),
                                  relevance_score=scores[i]) for i in top],
        ).model_dump())

    return router

"""Pydantic models of the OpenAI-compatible HTTP API's answers: responses, stream chunks,
model cards and the error envelope (the requests: ``protocol.py``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from tpserve.server.http.protocol import ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs; an echoed prompt's first token has null entries."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs`` (keyed by token id): ``rank`` 1 is the most
    likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first null), the token itself and the top
# alternatives, keyed by token id
PromptLogprobsList = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    # vLLM's return_token_ids (streamed: the prompt's in a choice's first chunk)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """With ``--reasoning-parser``, ``reasoning`` holds the model's thinking and
    ``reasoning_content`` the same (vLLM's older name). ``role`` is ``--response-role``
    (vLLM's; "assistant" by default) for requests with ``add_generation_prompt``, else
    the last message's role (the turn the answer continues), as in vLLM. An answer
    without tool calls has no ``tool_calls`` key (OpenAI's shape, and vLLM's: ``[]``
    made the openai SDK's ``message.tool_calls`` an empty list instead of None)."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_text: str | None = None  # vLLM's return_prompt_text


class DeltaMessage(BaseModel):
    """A stream delta; fields left None are omitted, as OpenAI does."""

    role: str | None = None  # the first delta's: as ChatResponseMessage.role
    content: str | None = None
    reasoning: str | None = None  # --reasoning-parser; reasoning_content the same
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # with "index" (see http/tools.py)

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the first chunk's
    prompt_text: str | None = None  # vLLM's return_prompt_text: the first chunk's


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission entry of a model card, its defaults."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tpserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # tpserve's extension (vLLM has none): the defaults that replace OpenAI's for sampling
    # fields a request omits (the model's generation config); {} = OpenAI's defaults
    default_sampling_params: dict[str, float | int] = Field(default_factory=dict)
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


ERROR_STATUSES = (400, 401, 404, 413, 429, 500, 503)
# the error answers every API route declares in its OpenAPI schema (OpenAI's envelope)
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse} for status in ERROR_STATUSES}
# and those of /v1/messages and the paths below it (Anthropic's envelope)
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": AnthropicErrorResponse} for status in ERROR_STATUSES}

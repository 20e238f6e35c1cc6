"""Pydantic models of the OpenAI-compatible HTTP API's requests (the answers, stream chunks
and the error envelope: ``replies.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
TokenIds = list[StrictInt]  # no bools or floats posing as token ids



def _lone_surrogate_at(data: Any) -> str | None:
    """Where in parsed JSON a string (or key) holds a lone UTF-16 surrogate, else None.

    JSON may escape one (``"\\ud800"``), but it is no Unicode character: UTF-8 encoding,
    the tokenizer and the JSON answer that echoes it would all fail.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if _lone_surrogate_at(key) is not None:
                    return path or "a key"
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item)
                         for i, item in enumerate(value))
    return None


class RequestModel(BaseModel):
    """A request body: every string in it must be valid Unicode (400 otherwise)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where or 'a string'} is not valid Unicode: it holds a lone "
                             "UTF-16 surrogate")
        return data


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage; with it, vLLM's
    ``continuous_usage_stats`` puts the usage so far in every chunk too."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class RepetitionDetectionParams(BaseModel):
    """vLLM's ``repetition_detection`` (``model.sampling_params.RepetitionDetection``);
    ``max_pattern_size`` 0 switches it off."""

    model_config = ConfigDict(extra="forbid")

    max_pattern_size: StrictInt = 0
    min_pattern_size: StrictInt = 0
    min_count: StrictInt = 0


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``; ``strict`` is accepted: the output always follows
    the schema (no properties beyond the declared ones)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuralTagItem(BaseModel):
    """One of a legacy structural tag's ``structures``: text from ``begin`` to ``end``
    whose content follows ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    begin: str
    tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """``text``, ``json_object``, ``json_schema``, or vLLM's ``structural_tag``: xgrammar's
    ``format`` or the legacy ``structures`` and ``triggers`` (``http/structured.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[StructuralTagItem] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _tag_fields_with_their_type(self) -> ResponseFormat:
        if self.type != "structural_tag" and (self.format is not None or self.structures
                                              is not None or self.triggers is not None):
            raise ValueError("format, structures and triggers are fields of the "
                             "structural_tag type")
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: at most one of the constraints, and vLLM's options
    for them (each checked by ``http/structured.py``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_value: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # its JSON text, either form (http/structured.py)
    # either way: JSON output is always compact, what true asks; false only permits spaces
    disable_any_whitespace: bool | None = None
    # either way, except true with an object schema unevaluatedProperties opens (a 400)
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None  # refused when set


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI plus vLLM extensions).

    Unknown fields are kept in ``model_extra``: the route logs each name once and ignores
    it (as vLLM does). Known OpenAI fields the server cannot honour are declared and
    refused with 400 (``http/unsupported.py``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's: a stream's chunks carry at least this many new tokens (the first and last
    # go at once; at least --stream-interval; http/stream_interval.py)
    stream_interval: int | None = Field(default=None, ge=1)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: every prompt token after the first scored, with this many top alternatives
    # (not with stream, as vLLM); the answer's ``prompt_logprobs``
    prompt_logprobs: int | None = None
    # vLLM's: only the prompt's last k tokens (-1: its last max_model_len); its first k
    # with truncation_side "right"
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprob tokens named "token_id:<id>" instead of their text
    return_tokens_as_token_ids: bool | None = None  # None: --return-tokens-as-token-ids
    # vLLM's: the prompt's and each choice's token ids beside the text
    return_token_ids: bool | None = False
    # vLLM's: prefix-cache hits only between requests with the same salt
    cache_salt: str | None = None
    # vLLM's: the answer's id is "{cmpl|chatcmpl}-{request_id}" (the engine's own id stays
    # unique, so two requests may share one)
    request_id: str | None = None
    # vLLM's: only these ids sampled; words never completed (http/structured.py, the sampler)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: at most this many thinking tokens, then the end of the thinking is forced (a
    # server with --reasoning-parser; http/reasoning/parser.py)
    thinking_token_budget: int | None = None
    # vLLM's: with logprobs, these tokens' log-probabilities at each output position (in
    # this order) instead of the top ones
    logprob_token_ids: TokenIds | None = None
    # vLLM's: the output ends (finish reason "repetition") once its tail repeats a pattern
    repetition_detection: RepetitionDetectionParams | None = None
    # vLLM fields this server cannot honour: refused with 400 unless set to their no-op
    # value (http/unsupported.py)
    priority: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    watermarking: bool | None = None
    vllm_xargs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    spaces_between_special_tokens: bool | None = None
    # structured output (one constraint at most; see http/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """``max_tokens`` left out: 16 at most, OpenAI's and vLLM's default for completions
    (``request_params.COMPLETIONS_MAX_TOKENS``); null: the room the prompt leaves."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None  # refused unless 1
    suffix: str | None = None   # refused unless empty
    # vLLM's: the tokenizer's special tokens (e.g. BOS) around a text prompt
    add_special_tokens: bool = True
    # vLLM's prompts as embeddings (--enable-prompt-embeds): refused with 400
    prompt_embeds: Any = None


class TextContentPart(BaseModel):
    """A text part; vLLM takes the Responses API's ``input_text`` and ``output_text`` parts
    as text too."""

    type: Literal["text", "input_text", "output_text"]
    text: str


class RefusalContentPart(BaseModel):
    """OpenAI's ``refusal`` part (of an assistant message): text to the template, as vLLM
    renders it (it takes one in any message)."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


class MediaContentPart(BaseModel):
    """An image, audio or file part: parsed so that it gets a clear 400 (text-only model)."""

    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text


class ToolCall(BaseModel):
    """A call in an assistant message (history) or in a response's ``message.tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # OpenAI's roles, or any other (Llama 3.1's ipython, GLM's observation...), handed to
    # the template as it is (vLLM's CustomChatCompletionMessageParam); not OpenAI's
    # deprecated function role
    role: str
    content: str | list[TextContentPart | RefusalContentPart | MediaContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role tool: the call this message answers
    tool_calls: list[ToolCall] | None = None  # role assistant: calls it made
    # role assistant: its reasoning (vLLM's two names), given to templates that show it
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("role")
    @classmethod
    def _not_function(cls, role: str) -> str:
        if role == "function":
            raise ValueError("the function role (OpenAI's deprecated function calling) is not "
                             "supported: answer a tool call with a tool message")
        return role

    def text(self) -> str:
        """The content as one string: its text (and refusal) parts joined by newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.text_parts())

    def text_parts(self) -> list[TextContentPart | RefusalContentPart]:
        """The content's text and refusal parts (a string: none)."""
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if isinstance(p, TextContentPart | RefusalContentPart)]

    @property
    def media_type(self) -> str | None:
        """The type of the first non-text content part, if any."""
        if isinstance(self.content, list):
            for part in self.content:
                if isinstance(part, MediaContentPart):
                    return part.type
        return None


class ChatTemplateOptions(BaseModel):
    """vLLM's chat-template fields (chat completions and /tokenize): ``add_generation_prompt``
    (the assistant turn's opening), ``continue_final_message`` (the last message left open
    for the model to continue; not with ``add_generation_prompt``), ``chat_template_kwargs``
    (more variables for the template, e.g. a model's ``enable_thinking``), ``chat_template``
    (this request's template instead of the server's) and ``documents`` (for templates
    that take them, as Hugging Face's RAG templates do)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    # OpenAI's, as vLLM gives it to the template (with enable_thinking): http/reasoning_effort.py
    reasoning_effort: str | None = None


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    # vLLM's: the answer starts with the last message's content when it is an assistant's
    echo: bool | None = False
    # vLLM's: with --reasoning-parser, false leaves the reasoning out of the answer
    include_reasoning: bool = True
    # vLLM's: the answer carries the prompt the chat template wrote (``prompt_text``; a
    # stream's first chunk)
    return_prompt_text: bool | None = None
    # vLLM's: the tokenizer's special tokens on top of what the chat template writes
    add_special_tokens: bool = False
    # tool calling (http/tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this server cannot honour: refused with 400 when set (http/unsupported.py)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    verbosity: str | None = None
    # advisory in OpenAI's API (no effect on the output): accepted and ignored
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel, ChatTemplateOptions):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None  # shown to the chat template, as on chat (vLLM's)
    add_special_tokens: bool = False
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds

"""Prompt preprocessing: text and chat messages to token ids, ids back to text.

Tokenizer calls run on a single worker thread so that long prompts do not stall the event
loop (and Hugging Face fast tokenizers are never used from two threads at once).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from tpserve.server.http.content_format import detected_content_format
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatMessage, ChatTemplateOptions, ToolCall
from tpserve.server.http.reasoning_effort import effort_kwargs, template_source

# apply_chat_template's own arguments, which a request's chat_template_kwargs cannot set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

CompletionPrompt = str | list[int] | list[str] | list[list[int]]

# vLLM's words, without --trust-request-chat-template
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template "
                      "is not set. Refused request with untrusted chat template.")


def _as_ids(value: Any) -> list[int]:
    if hasattr(value, "keys") and "input_ids" in value:  # BatchEncoding
        value = value["input_ids"]
    return [int(t) for t in value]


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A history tool call as templates read it: ``arguments`` decoded from JSON (Hugging
    Face templates write ``arguments | tojson`` or iterate ``arguments | items``), and ``{}``
    for arguments that are not JSON (empty, malformed), as vLLM's _postprocess_messages."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = {}
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": arguments}}


def _content_parts(m: ChatMessage) -> list[dict[str, str]]:
    """A message's content as OpenAI's list of text parts (none for no content; refusal,
    ``input_text`` and ``output_text`` parts are text parts, as vLLM gives them)."""
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [{"type": "text", "text": m.content}]
    return [{"type": "text", "text": p.text} for p in m.text_parts()]


def _first_tokens(tokenizer: Any, text: str, limit: int) -> str:
    """``text`` cut to its first ``limit`` tokens (no special tokens counted), at the
    character where the last kept token ends (vLLM's ``truncate_text_to_tokens``; a
    tokenizer without offsets: those tokens decoded)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # no offsets (a slow tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= limit else tokenizer.decode(ids[:limit])
    if len(enc["input_ids"]) <= limit:
        return text
    return text[:enc["offset_mapping"][limit - 1][1]]


class PromptProcessor:
    def __init__(self, tokenizer: Any, executor: Executor, chat_template: str | None = None,
                 default_template_kwargs: Mapping[str, Any] | None = None,
                 content_format: str = "auto", trust_request_template: bool = False):
        self.tokenizer = tokenizer
        self.executor = executor
        self.vocab_size = len(tokenizer)
        self.chat_template = chat_template  # replaces the tokenizer's when set
        # --default-chat-template-kwargs: under each request's chat_template_kwargs
        self.default_template_kwargs = dict(default_template_kwargs or {})
        # --chat-template-content-format: content as a string, or as a list of text parts
        # (openai); auto: as the template reads it (detected_content_format)
        self.content_format = content_format
        # --trust-request-chat-template: a request's chat_template rendered, else refused
        self.trust_request_template = trust_request_template

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def first_tokens(self, texts: list[str], limit: int) -> list[str]:
        """Each text cut to its first ``limit`` tokens (``_first_tokens``; 0: as they are),
        on the tokenizer's thread (score and rerank's ``max_tokens_per_query/doc``)."""
        if not limit:
            return texts
        return await self._run(lambda: [_first_tokens(self.tokenizer, t, limit)
                                        for t in texts])

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError.bad_request(
                    f"token id {t} is out of range [0, {self.vocab_size})", param=param)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _as_ids(await self._run(self.tokenizer.encode, text,
                                       add_special_tokens=add_special_tokens))

    async def encode_pair(self, text: str, pair: str) -> list[int]:
        """A cross-encoder's input: ``text`` and ``pair`` as the tokenizer joins a pair
        (its special tokens and separators; as vLLM tokenizes a score pair)."""
        return _as_ids(await self._run(
            lambda: self.tokenizer(text=text, text_pair=pair)["input_ids"]))

    async def decode(self, ids: Sequence[int], param: str = "tokens") -> str:
        self.check_ids(ids, param)
        return await self._run(self.tokenizer.decode, list(ids))

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        return list(await self._run(self.tokenizer.convert_ids_to_tokens, list(ids)))

    async def completion_prompts(self, prompt: CompletionPrompt,
                                 add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of each prompt of a completions ``prompt``: one string, one list
        of ids, or a list of either (a string's with the tokenizer's special tokens unless
        ``add_special_tokens`` is false)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return [await self.completion_ids(p, add_special_tokens) for p in prompt]
        if isinstance(prompt, list) and not prompt:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        return [await self.completion_ids(prompt, add_special_tokens)]

    async def completion_ids(self, prompt: str | list[int],
                             add_special_tokens: bool = True) -> list[int]:
        """The token ids of one completions prompt (a string or a list of ids)."""
        if isinstance(prompt, str):
            ids = await self.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            self.check_ids(ids, "prompt")
        if not ids:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        return ids

    async def render_chat(self, messages: Sequence[ChatMessage], options: ChatTemplateOptions,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template (the request's ``chat_template``, refused with 400 unless
        ``--trust-request-chat-template``; else ``--chat-template``, else the model's)
        applied to ``messages`` as a request's ``options`` say (and ``tools`` and
        ``documents``, as Hugging Face templates take them); ``chat_template_kwargs`` are
        more template variables, over the server's defaults (400 for one that names an
        argument set here); ``reasoning_effort`` sets the variables ``reasoning_effort.py``
        says. Each message reaches the template as vLLM gives it (``_conversation``).
        Templates render in transformers' sandboxed environment."""
        if options.add_generation_prompt and options.continue_final_message:
            raise APIError.bad_request("add_generation_prompt and continue_final_message "
                                       "cannot both be true", "continue_final_message")
        if options.chat_template is not None and not self.trust_request_template:
            raise APIError.bad_request(UNTRUSTED_TEMPLATE, "chat_template")
        template_kwargs = {**self.default_template_kwargs, **(options.chat_template_kwargs or {})}
        taken = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise APIError.bad_request(f"chat_template_kwargs cannot set {', '.join(taken)}",
                                       "chat_template_kwargs")
        template = options.chat_template if options.chat_template is not None \
            else self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError.bad_request("this model has no chat template", "messages")
        source = template_source(template, getattr(self.tokenizer, "chat_template", None),
                                 bool(tools))
        content_format = self.content_format
        if content_format == "auto":
            content_format = detected_content_format(source)
        conversation = self._conversation(messages, content_format == "openai")
        kwargs: dict[str, Any] = {**template_kwargs, "tokenize": False,
                                  "add_generation_prompt": options.add_generation_prompt}
        if template is not None:
            kwargs["chat_template"] = template
        if options.documents is not None:
            kwargs["documents"] = options.documents
        if options.continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None:
            kwargs["tools"] = tools
        if options.reasoning_effort is not None:
            asked = options.chat_template_kwargs or {}
            kwargs.update(effort_kwargs(options.reasoning_effort, source, asked))
            kwargs.update(asked)  # the request's own variables win
        try:
            text = await self._run(self.tokenizer.apply_chat_template, conversation, **kwargs)
        except Exception as exc:  # jinja2 errors, template raise_exception(), bad roles
            raise APIError.bad_request(f"could not apply the chat template: {exc}",
                                       "messages") from exc
        if not isinstance(text, str):
            raise APIError(500, "chat template did not render to text")
        return text

    @staticmethod
    def _conversation(messages: Sequence[ChatMessage], parts: bool) -> list[dict[str, Any]]:
        """``messages`` as the template reads them (vLLM's parse_chat_messages): content as
        a string, or with ``parts`` as OpenAI's list of text parts (a tool result's always
        a string: most templates print it); the developer role as system; an assistant's
        reasoning as ``reasoning`` and ``reasoning_content``; history tool calls'
        arguments decoded (``_template_call``)."""
        conversation = []
        for i, m in enumerate(messages):
            if m.media_type is not None:
                raise APIError.bad_request(
                    f"{m.media_type} content parts are not supported: this model takes text "
                    "only", f"messages.{i}.content")
            # OpenAI's developer role is the system role of models without one of its own
            role = "system" if m.role == "developer" else m.role
            item: dict[str, Any] = {"role": role, "content": _content_parts(m)
                                    if parts and m.role != "tool" else m.text()}
            if m.name is not None:
                item["name"] = m.name
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                item["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
            if reasoning is not None and m.role == "assistant":  # e.g. Qwen3's template
                item["reasoning"] = item["reasoning_content"] = reasoning
            conversation.append(item)
        return conversation

    async def chat_ids(self, messages: Sequence[ChatMessage], options: ChatTemplateOptions, *,
                       add_special_tokens: bool = False,
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of ``messages`` rendered as ``render_chat`` does."""
        return (await self.chat_prompt(messages, options, add_special_tokens=add_special_tokens,
                                       tools=tools))[1]

    async def chat_prompt(self, messages: Sequence[ChatMessage], options: ChatTemplateOptions,
                          *, add_special_tokens: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """``messages`` rendered as ``render_chat`` does, and its token ids (400 for none)."""
        text = await self.render_chat(messages, options, tools)
        ids = await self.encode(text, add_special_tokens=add_special_tokens)
        if not ids:
            raise APIError.bad_request("messages render to an empty prompt", "messages")
        return text, ids

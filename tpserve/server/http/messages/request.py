"""A Messages request and its chat request: ``system`` to a system message, text blocks to
text, ``tool_use`` blocks to an assistant message's ``tool_calls``, ``tool_result`` blocks
to tool messages, ``tools`` and ``tool_choice`` to chat's; fields this server cannot honour
are refused with 400."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict

from tpserve.server.http.chat_conversion import function_tool, renamed_error, validated_chat
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, RequestModel
from tpserve.server.http.unsupported import refuse_fields

# vLLM's sampling extensions a Messages request may carry; passed to the chat request
PASSED_THROUGH = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "seed", "stop_token_ids", "ignore_eos", "min_tokens", "priority",
                  "cache_salt", "chat_template_kwargs")

# Claude Code's first system block ("x-anthropic-billing-header: ...; cch=..."): a
# per-request value for Anthropic's billing, not for the model; left in the prompt it would
# make every prompt's start differ and defeat the prefix cache (vLLM drops it too)
BILLING_HEADER = "x-anthropic-billing-header"

REFUSED = {  # refused unless set to their no-op value (http/unsupported.py)
    "mcp_servers": "MCP servers are not supported: the server runs no tools",
    "container": "containers are not supported: the server runs no tools",
}


class MessagesRequest(RequestModel):
    """``POST /v1/messages``. Unknown fields are kept in ``model_extra`` (logged once and
    ignored, as on chat completions); vLLM's sampling fields among them
    (``PASSED_THROUGH``) apply."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # ``format``: a JSON schema the answer follows
    speed: str | None = None
    # advisory: accepted and ignored
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # refused unless empty (``REFUSED``)
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | None = None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: a Messages request whose ``max_tokens`` may be
    left out (the answer's length does not change its prompt)."""

    max_tokens: int = 1


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks (``cache_control`` and citations
    ignored); any other block is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{where} must be a string or a list of content blocks",
                                   where)
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError.bad_request(f"{kind} content blocks are not supported here: this "
                                       "model takes text only", f"{where}.{k}")
        texts.append(block["text"])
    return "".join(texts)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise APIError.bad_request("a tool_use block needs an id and a name", where)
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": json.dumps(block.get("input") or {})}}


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``system`` (without a billing header block:
    ``BILLING_HEADER``) and ``messages``. A user turn's ``tool_result``
    blocks become tool messages (before its text); an assistant turn's ``tool_use``
    blocks its ``tool_calls``, its ``thinking`` blocks its ``reasoning_content`` (the
    template decides whether to show it, as on chat); ``redacted_thinking`` blocks are
    dropped (their content is opaque)."""
    out: list[dict[str, Any]] = []
    system = req.system
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and b.get("type") == "text"
                                            and str(b.get("text")).startswith(BILLING_HEADER))]
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    if not req.messages:
        raise APIError.bad_request("messages must hold at least one message", "messages")
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise APIError.bad_request(f"{where}.role must be user or assistant", where)
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError.bad_request(f"{where}.content must be a string or a list of "
                                       "content blocks", f"{where}.content")
        if not content and not (role == "assistant" and i == len(req.messages) - 1):
            raise APIError.bad_request(  # as Anthropic: only a final assistant turn may be
                f"{where}.content holds no content block: every message but a final "
                "assistant one needs content", f"{where}.content")
        texts, calls, thoughts = [], [], []
        for k, block in enumerate(content):
            at = f"{where}.content.{k}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and role == "assistant" \
                    and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(block, at))
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError.bad_request("a tool_result block needs a tool_use_id", at)
                result = _text(block.get("content") or "", f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": result})
            else:
                raise APIError.bad_request(f"{kind} content blocks are not supported in "
                                           f"{role} messages: this model takes text and tools",
                                           at)
        if texts or calls or role == "assistant":
            turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            if thoughts:
                turn["reasoning_content"] = "".join(thoughts)
            out.append(turn)
    return out


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if not isinstance(tool.get("name"), str) or tool.get("type", "custom") != "custom" \
                or "input_schema" not in tool:
            raise APIError.bad_request(f"tools of type {tool.get('type')!r} are not supported:"
                                       " only client tools (name, input_schema)", f"tools.{i}")
        tools.append(function_tool(tool["name"], tool.get("description"),
                                   tool["input_schema"]))
    return tools


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError.bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, '
                               '{"type": "none"} or {"type": "tool", "name": ...}',
                               "tool_choice")


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema) as chat's ``response_format``; an
    ``effort`` is a 400."""
    config = config or {}
    if config.get("effort") is not None:
        raise APIError.bad_request("output_config.effort is not supported with this model",
                                   "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise APIError.bad_request('output_config.format must be {"type": "json_schema", '
                                   '"schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None, reasons: bool
              ) -> tuple[dict[str, Any] | None, int | None]:
    """The chat template's arguments for ``thinking``, and the thinking's cap: ``disabled``
    is Qwen3's ``enable_thinking: false`` (templates without the switch ignore it);
    ``enabled`` and ``adaptive`` need a server that splits reasoning off (``reasons``: a
    ``--reasoning-parser``), whose model then thinks as it was trained to. ``enabled``'s
    ``budget_tokens`` is enforced as vLLM's ``thinking_token_budget`` (Anthropic calls it a
    target; here the thinking ends when it is spent), and ``max_tokens`` bounds thinking
    and answer together."""
    kind = None if thinking is None else thinking.get("type")
    if kind is None:
        return None, None
    if kind == "disabled":
        return {"enable_thinking": False}, None
    if kind not in ("enabled", "adaptive"):
        raise APIError.bad_request(f"thinking.type must be enabled, adaptive or disabled, "
                                   f"got {kind!r}", "thinking.type")
    if not reasons:
        raise APIError.bad_request("extended thinking needs a server started with "
                                   "--reasoning-parser (this one has none)", "thinking")
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 0):
        raise APIError.bad_request(f"thinking.budget_tokens must be a whole number of "
                                   f"tokens, at least 0, got {budget!r}",
                                   "thinking.budget_tokens")
    return {"enable_thinking": True}, budget


def chat_request(req: MessagesRequest, reasons: bool = False) -> ChatCompletionRequest:
    """The chat request that answers ``req`` (400s naming the Messages field); ``reasons``:
    the server splits reasoning off (``--reasoning-parser``), so the answer may think."""
    refuse_fields(req, REFUSED)
    template_kwargs, thinking_budget = _thinking(req.thinking, reasons)
    if req.max_tokens < 1:
        raise APIError.bad_request(f"max_tokens must be at least 1, got {req.max_tokens}",
                                   "max_tokens")
    if req.speed not in (None, "standard"):
        raise APIError.bad_request(f"speed {req.speed!r} is not supported (standard)", "speed")
    choice, parallel = _tool_choice(req.tool_choice)
    messages = _messages(req)
    # a last assistant turn of text is a prefill: the answer continues it
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences, "stream": req.stream, "tools": _tools(req),
        "tool_choice": choice, "parallel_tool_calls": parallel,
        "response_format": _response_format(req.output_config),
        "add_generation_prompt": False if prefill else None,
        "continue_final_message": True if prefill else None,
        "stream_options": {"include_usage": True} if req.stream else None,
        "thinking_token_budget": thinking_budget}
    extra = req.model_extra or {}
    body.update({name: extra[name] for name in PASSED_THROUGH if name in extra})
    kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and (kwargs is None or isinstance(kwargs, dict)):
        body["chat_template_kwargs"] = {**template_kwargs, **(kwargs or {})}  # the request's win
    return validated_chat(body, MESSAGES_NAME)


# chat field -> the Messages field it came from, for error messages
MESSAGES_NAME = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                 "response_format": "output_config.format"}


def messages_error(exc: APIError) -> APIError:
    """``exc`` (raised by the chat machinery) naming the Messages field."""
    return renamed_error(exc, MESSAGES_NAME)

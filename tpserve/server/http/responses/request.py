"""A Responses request and its chat request: ``input`` items to chat messages,
``instructions`` to a system message, ``text.format`` to ``response_format``, function
tools to chat tools; fields this server cannot honour are refused with 400."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from tpserve.server.http.chat_conversion import function_tool, renamed_error, validated_chat
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, RequestModel
from tpserve.server.http.responses.output import new_id
from tpserve.server.http.unsupported import refuse_fields

# vLLM's sampling extensions a Responses request may carry; passed to the chat request
PASSED_THROUGH = ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "min_tokens", "priority", "cache_salt", "chat_template_kwargs",
                  "include_reasoning")

REFUSED = {  # refused unless set to their no-op value (http/unsupported.py)
    "conversation": "conversations are not supported: responses are not stored",
    "background": "background responses are not supported",
    "include": "include is not supported: there is no encrypted reasoning, and output "
               "logprobs are not offered on this endpoint",
    "prompt": "prompt templates are not supported",
    "truncation": "only truncation 'disabled' is supported",
    "max_tool_calls": "max_tool_calls is not supported: the server runs no tools",
    "top_logprobs": "top_logprobs is not supported on this endpoint",
    "reasoning": "reasoning.summary is not supported: reasoning is returned as it is "
                 "written",
}


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``. Unknown fields are kept in ``model_extra`` (logged once and
    ignored, as on chat completions); vLLM's sampling fields among them (``PASSED_THROUGH``)
    apply."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # kept unless false, where the server keeps responses (--responses-store-size,
    # responses/store.py); else accepted, and the answer says ``store: false``
    store: bool | None = None
    # advisory in OpenAI's API: accepted and ignored
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # a stored response this one continues (responses/store.py)
    previous_response_id: str | None = None
    # refused unless their no-op value (REFUSED)
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None


class _Part(BaseModel):
    type: str
    text: str | None = None


class _Message(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCall(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]


class _Reasoning(BaseModel):
    type: Literal["reasoning"]


_ITEMS = {"message": _Message, "function_call": _FunctionCall,
          "function_call_output": _FunctionCallOutput, "reasoning": _Reasoning}


def _text(content: str | list[_Part], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise APIError.bad_request(f"{part.type} content is not supported: this model "
                                       "takes text only", f"{where}.content.{k}")
        texts.append(part.text)
    return "".join(texts)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message), each with its
    ``type`` (``message`` where the client left it out, as the API allows) and an ``id``
    (a new one where the client gave none); a message's string ``content`` becomes one
    text part and its ``status`` completed, as OpenAI lists input items."""
    items = ([{"type": "message", "role": "user", "content": req.input}]
             if isinstance(req.input, str) else req.input)
    out = []
    for item in items:
        kind = item.get("type", "message")
        out.append({"type": kind, "id": new_id("msg" if kind == "message" else "item"),
                    **item})
        if kind == "message" and isinstance(item.get("content"), str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []}
                    if item.get("role") == "assistant"
                    else {"type": "input_text", "text": item["content"]})
            out[-1] = {"status": "completed", **out[-1], "content": [part]}
    return out


def _messages(instructions: str | None, previous: list[dict[str, Any]],
              own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of ``instructions``, the ``previous`` response's conversation
    (stored: already checked) and the request's own items (``input_items``; a 400 names
    ``input.i``). Consecutive function calls become one assistant message's
    ``tool_calls``; reasoning items are dropped (the templates of the models served here do
    not take them back)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, raw in enumerate([*previous, *own], start=-len(previous)):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError.bad_request(f"input items of type {kind!r} are not supported "
                                       f"(message, function_call, function_call_output, "
                                       f"reasoning)", f"input.{i}")
        try:
            item = model.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise APIError.bad_request(f"input.{i}.{where}: {first['msg']}",
                                       f"input.{i}") from None
        if isinstance(item, _Message):
            messages.append({"role": item.role, "content": _text(item.content, f"input.{i}")})
        elif isinstance(item, _FunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, _FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input.{i}.output")})
    if not messages:
        raise APIError.bad_request("input must hold at least one message", "input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise APIError.bad_request(f"tools of type {tool.get('type')!r} are not supported: "
                                       "only function tools (with a name)", f"tools.{i}")
        tools.append(function_tool(tool["name"], tool.get("description"),
                                   tool.get("parameters")))
    return tools


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError.bad_request("tool_choice must be none, auto, required or "
                               '{"type": "function", "name": ...}', "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``; any other key of ``text``
    (``verbosity``: as chat completions' ``verbosity``) is a 400 naming it."""
    other = sorted(set(text or {}) - {"format"})
    if other:
        raise APIError.bad_request(f"text.{other[0]} is not supported with this model",
                                   f"text.{other[0]}")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "strict") if k in fmt}
        schema["schema"] = fmt.get("schema")
        return {"type": "json_schema", "json_schema": schema}
    raise APIError.bad_request(f"text.format type {kind!r} is not supported (text, "
                               "json_object, json_schema)", "text.format")


def chat_request(req: ResponsesRequest, previous: list[dict[str, Any]] | None = None,
                 own: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat request that answers ``req``, continuing the ``previous`` response's
    conversation; ``own``: ``input_items(req)`` where the caller has them already (400s
    naming the Responses field)."""
    refuse_fields(req, REFUSED)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req.instructions, previous or [],
                              input_items(req) if own is None else own),
        "temperature": req.temperature,
        "top_p": req.top_p, "max_completion_tokens": req.max_output_tokens,
        "stream": req.stream, "tools": _tools(req), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        "stream_options": {"include_usage": True} if req.stream else None,
        # the answer's token ids, for the reasoning tokens of the usage
        "return_token_ids": True}
    extra = req.model_extra or {}
    body.update({name: extra[name] for name in PASSED_THROUGH if name in extra})
    return validated_chat(body, RESPONSES_NAME)


# chat field -> the Responses field it came from, for error messages
RESPONSES_NAME = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                  "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def responses_error(exc: APIError) -> APIError:
    """``exc`` (raised by the chat machinery) naming the Responses field."""
    return renamed_error(exc, RESPONSES_NAME)


def echo_fields(req: ResponsesRequest, stored: bool = False,
                defaults: Mapping[str, float | int] | None = None) -> dict[str, Any]:
    """What a response object repeats of its request; ``stored``: the server keeps it;
    ``temperature`` and ``top_p`` are the values used (the request's, else the server's
    ``defaults``, else OpenAI's 1.0), as OpenAI's and vLLM's response objects give them."""
    used = defaults or {}
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": float(req.temperature if req.temperature is not None
                                 else used.get("temperature", 1.0)),
            "top_p": float(req.top_p if req.top_p is not None else used.get("top_p", 1.0)),
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "metadata": req.metadata or {}, "user": req.user, "store": stored,
            "background": False, "previous_response_id": req.previous_response_id,
            "truncation": "disabled",
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}}


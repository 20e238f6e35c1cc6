"""Response objects and their output items, from a chat answer."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.openai_format import ResponseContext
from tpserve.server.http.protocol import ToolCall
from tpserve.server.http.replies import ChatCompletionResponse, UsageInfo


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def function_call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id,
            "name": call.function.name, "arguments": call.function.arguments,
            "status": status}


def reasoning_tokens(ctx: ResponseContext, token_ids: Sequence[int], reasoning: str | None
                     ) -> int:
    """The output tokens up to and including the first ``</think>`` (all of them when
    the output reasoned to its end), when the answer has reasoning; else 0."""
    if ctx.reasoning is None or not reasoning:
        return 0
    end = ctx.reasoning.parser.end_id
    return token_ids.index(end) + 1 if end in token_ids else len(token_ids)


def usage_object(usage: UsageInfo | None, reasoning: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage.total_tokens}


def response_object(ctx: ResponseContext, echo: dict[str, Any], status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """A response object; a finish by length makes it ``incomplete``."""
    incomplete = None
    if finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {"id": ctx.id, "object": "response", "created_at": ctx.created,
            "model": ctx.model, "status": status, "error": None,
            "incomplete_details": incomplete, "output": output, "usage": usage, **echo}


def whole_response(chat: ChatCompletionResponse, ctx: ResponseContext,
                   echo: dict[str, Any]) -> dict[str, Any]:
    """The response object of a whole (non-streamed) chat answer: its reasoning, its
    message and its function calls as output items, in that order."""
    choice = chat.choices[0]
    message = choice.message
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    output = []
    if message.reasoning:
        output.append(reasoning_item(new_id("rs"), message.reasoning, status))
    if message.content:
        output.append(message_item(new_id("msg"), message.content, status))
    output += [function_call_item(new_id("fc"), call, "completed")
               for call in message.tool_calls]
    usage = usage_object(chat.usage, reasoning_tokens(ctx, choice.token_ids or [],
                                                      message.reasoning))
    return response_object(ctx, echo, "completed", output, usage, choice.finish_reason)

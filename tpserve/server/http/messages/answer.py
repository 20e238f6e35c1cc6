"""A Messages answer from a chat answer: the whole message object, or the Messages
stream's events (``message_start``, a start, deltas and a stop per content block,
``message_delta`` with the stop reason and usage, ``message_stop``). The blocks come in
the order the model wrote them: its reasoning (``--reasoning-parser``) as a ``thinking``
block, its text, its tool calls."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.generation import close_outputs
from tpserve.server.http.http_errors import ANTHROPIC_PATH
from tpserve.server.http.openai_format import ResponseContext
from tpserve.server.http.protocol import ToolCall
from tpserve.server.http.replies import ChatCompletionResponse, UsageInfo
from tpserve.server.http.streaming import chat_chunks, stream_error

STOP_REASONS: dict[str | None, str | None] = {
    "stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", None: None}


def stop_reason(finish_reason: str | None, matched: int | str | None,
                stop_sequences: list[str] | None, called: bool
                ) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a chat finish: a stop string
    of the request that ended the answer is a ``stop_sequence``; an answer that ends in
    tool calls (``called``; a named tool choice finishes as ``stop``) is ``tool_use``."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    if called and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:  # a parser passes on what the model wrote
        arguments = {}
    return {"type": "tool_use", "id": call.id, "name": call.function.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def thinking_block(thinking: str) -> dict[str, Any]:
    """A ``thinking`` block. Its ``signature`` only lets clients that require one send the
    block back: this server checks none, and the thinking reaches the template as the
    turn's ``reasoning_content`` (``request.py``)."""
    return {"type": "thinking", "thinking": thinking, "signature": uuid.uuid4().hex}


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int
                 ) -> dict[str, Any]:
    """Anthropic's usage: the prompt's tokens found in the prefix cache are read from the
    cache, the others are input."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _chat_usage(usage: UsageInfo) -> dict[str, Any]:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return usage_object(usage.prompt_tokens, cached, usage.completion_tokens)


def message_object(ctx: ResponseContext, content: list[dict[str, Any]],
                   reason: tuple[str | None, str | None], usage: dict[str, Any]
                   ) -> dict[str, Any]:
    return {"id": ctx.id, "type": "message", "role": "assistant",
            "model": ctx.model, "content": content, "stop_reason": reason[0],
            "stop_sequence": reason[1], "usage": usage}


def whole_message(chat: ChatCompletionResponse, ctx: ResponseContext,
                  stop_sequences: list[str] | None) -> dict[str, Any]:
    """The message object of a whole (non-streamed) chat answer: its text, then its tool
    calls as ``tool_use`` blocks."""
    choice = chat.choices[0]
    content = [thinking_block(choice.message.reasoning)] if choice.message.reasoning else []
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    content += [tool_use_block(call) for call in choice.message.tool_calls]
    reason = stop_reason(choice.finish_reason, choice.stop_reason, stop_sequences,
                         bool(choice.message.tool_calls))
    assert chat.usage is not None, "a whole chat answer carries its usage"
    return message_object(ctx, content, reason, _chat_usage(chat.usage))


def _event(kind: str, **fields: Any) -> bytes:
    payload = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class _Blocks:
    """The content blocks of a stream: at most one open, numbered from 0 in order."""

    def __init__(self) -> None:
        self.index = 0
        self.kind: str | None = None  # the open block's type, None when none is open

    def open(self, kind: str, start: dict[str, Any] | None = None) -> list[bytes]:
        """The events that make a block of ``kind`` the open one (a text or thinking
        block stays open across deltas; a ``tool_use`` block is always new)."""
        if self.kind == kind and kind != "tool_use":
            return []
        events = self.close()
        if start is None:
            start = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
        self.kind = kind
        return [*events, _event("content_block_start", index=self.index, content_block=start)]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)

    def close(self) -> list[bytes]:
        """The events that close the open block (a thinking block's signature first)."""
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            signature = thinking_block("")["signature"]
            events.append(self.delta({"type": "signature_delta", "signature": signature}))
        events.append(_event("content_block_stop", index=self.index))
        self.kind = None
        self.index += 1
        return events


async def message_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                         ctx: ResponseContext, stop_sequences: list[str] | None
                         ) -> AsyncIterator[bytes]:
    """The stream of one message: its reasoning in a ``thinking`` block that grows by
    ``thinking_delta``s and closes with its ``signature_delta``, its text in a block that
    grows by ``text_delta``s, each tool call a ``tool_use`` block whose input grows by
    ``input_json_delta``s as the chat stream's arguments do (a forced tool's as the model
    writes them, a parsed call's in one); an ``error`` event if the request fails
    mid-way."""
    yield _event("message_start", message=message_object(
        ctx, [], (None, None),
        usage_object(first.num_prompt_tokens, first.num_cached_tokens, 0)))
    blocks = _Blocks()
    called = False
    try:
        usage, finish, matched = None, None, None
        async for chunk in chat_chunks(first, outputs, ctx):
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.reasoning:
                    for e in blocks.open("thinking"):
                        yield e
                    yield blocks.delta({"type": "thinking_delta", "thinking": c.delta.reasoning})
                if c.delta.content:
                    for e in blocks.open("text"):
                        yield e
                    yield blocks.delta({"type": "text_delta", "text": c.delta.content})
                for raw in c.delta.tool_calls or ():
                    function = raw.get("function") or {}
                    if "id" in raw:  # a call begins (a whole one carries all its arguments)
                        for e in blocks.open("tool_use", {
                                "type": "tool_use", "id": raw["id"],
                                "name": function.get("name"), "input": {}}):
                            yield e
                        called = True
                    if function.get("arguments"):
                        yield blocks.delta({"type": "input_json_delta",
                                            "partial_json": function["arguments"]})
                if c.finish_reason is not None:
                    finish, matched = c.finish_reason, c.stop_reason
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(finish, matched, stop_sequences, called)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": usage.completion_tokens if usage else 0})
        yield _event("message_stop")
    except Exception as exc:
        yield _event("error", **stream_error(exc).body(ANTHROPIC_PATH))
    finally:
        await close_outputs(outputs)

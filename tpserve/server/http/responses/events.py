"""The Responses stream: chat chunks to ``response.*`` server-sent events."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.generation import close_outputs
from tpserve.server.http.openai_format import ResponseContext
from tpserve.server.http.protocol import FunctionCall, ToolCall
from tpserve.server.http.responses.output import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_tokens,
    response_object,
    usage_object,
)
from tpserve.server.http.streaming import chat_chunks, stream_error


class _Events:
    """Numbers the events and keeps the output items: at most one reasoning, message or
    function-call item is open at a time; its text (a call's arguments) grows by deltas
    until the next item (or the end) closes it."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the open item, as it will be when done
        self.text = ""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self.seq), **fields}
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    def delta(self, kind: str, text: str) -> list[bytes]:
        """``text`` added to an open item of ``kind`` (reasoning or message)."""
        out: list[bytes] = []
        if self.open is not None and self.open["type"] != kind:
            out += self.close("completed")
        where = {"output_index": len(self.output)}
        if self.open is None:
            item_id = new_id("rs" if kind == "reasoning" else "msg")
            self.open = reasoning_item(item_id, "", "in_progress") if kind == "reasoning" \
                else message_item(item_id, "", "in_progress")
            self.text = ""
            out.append(self.event("response.output_item.added", item=self.open, **where))
            out.append(self.event("response.content_part.added", item_id=item_id,
                                  content_index=0, part=self.open["content"][0], **where))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=self.open["id"], content_index=0, delta=text,
                              **extra, **where))
        return out

    def close(self, status: str) -> list[bytes]:
        """The open item's done events; it joins the output."""
        if self.open is None:
            return []
        if self.open["type"] == "function_call":
            return self._close_call()
        item, text, where = self.open, self.text, {"output_index": len(self.output)}
        done = (reasoning_item if item["type"] == "reasoning" else message_item)(
            item["id"], text, status)
        part = done["content"][0]
        name = "response.reasoning_text.done" if item["type"] == "reasoning" \
            else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        out = [self.event(name, item_id=item["id"], content_index=0, text=text, **extra,
                          **where),
               self.event("response.content_part.done", item_id=item["id"], content_index=0,
                          part=part, **where),
               self.event("response.output_item.done", item=done, **where)]
        self.output.append(done)
        self.open = None
        return out

    def function_call(self, call_id: str, name: str) -> list[bytes]:
        """A function-call item begins; its arguments come by ``arguments``."""
        out = self.close("completed")
        self.open = function_call_item(new_id("fc"), ToolCall(
            id=call_id, function=FunctionCall(name=name, arguments="")), "in_progress")
        self.text = ""
        out.append(self.event("response.output_item.added", item=self.open,
                              output_index=len(self.output)))
        return out

    def arguments(self, text: str) -> bytes:
        """``text`` added to the open function call's arguments."""
        assert self.open is not None and self.open["type"] == "function_call"
        self.text += text
        return self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                          delta=text, output_index=len(self.output))

    def _close_call(self) -> list[bytes]:
        assert self.open is not None
        done = {**self.open, "arguments": self.text, "status": "completed"}
        where = {"output_index": len(self.output)}
        self.output.append(done)
        self.open = None
        return [self.event("response.function_call_arguments.done", item_id=done["id"],
                           name=done["name"], arguments=done["arguments"], **where),
                self.event("response.output_item.done", item=done, **where)]


async def response_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                          ctx: ResponseContext, echo: dict[str, Any],
                          keep: Callable[[dict[str, Any]], None] | None = None
                          ) -> AsyncIterator[bytes]:
    """``response.created`` and ``response.in_progress``; per output item its added,
    delta and done events (reasoning text, output text, function-call arguments as the
    chat stream's: a forced call's as written, a parsed call's in one delta); then ``response.completed`` (``response.incomplete`` when ``max_output_tokens``
    cut it) with the whole response, or an ``error`` event. ``keep`` is handed the whole
    response before its event goes out (the response store)."""
    ev = _Events()
    start = response_object(ctx, echo, "in_progress", [], None)
    yield ev.event("response.created", response=start)
    yield ev.event("response.in_progress", response=start)
    try:
        usage, finish_reason, ids, reasoning = None, None, [], ""
        async for chunk in chat_chunks(first, outputs, ctx):
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
            for c in chunk.choices:
                ids += c.token_ids or []
                if c.delta.reasoning:
                    reasoning += c.delta.reasoning
                    for e in ev.delta("reasoning", c.delta.reasoning):
                        yield e
                if c.delta.content:
                    for e in ev.delta("message", c.delta.content):
                        yield e
                for raw in c.delta.tool_calls or ():
                    function = raw.get("function") or {}
                    if "id" in raw:  # a call begins (a whole one carries all its arguments)
                        for e in ev.function_call(raw["id"], function.get("name", "")):
                            yield e
                    if function.get("arguments"):
                        yield ev.arguments(function["arguments"])
                if c.finish_reason is not None:
                    finish_reason = c.finish_reason
        for e in ev.close("incomplete" if finish_reason == "length" else "completed"):
            yield e
        final = response_object(ctx, echo, "completed", ev.output,
                                usage_object(usage, reasoning_tokens(ctx, ids, reasoning)),
                                finish_reason)
        if keep is not None:
            keep(final)
        yield ev.event(f"response.{final['status']}", response=final)
    except Exception as exc:
        err = stream_error(exc)
        yield ev.event("error", code=err.type, message=err.message, param=err.param)
    finally:
        await close_outputs(outputs)

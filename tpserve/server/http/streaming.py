"""Server-sent events: the SSE response and the OpenAI chunk streams for both endpoints."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tpserve.server.engine.errors import EngineError
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput
from tpserve.server.http.call_scanner import CallArguments, CallStart
from tpserve.server.http.generation import close_outputs
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.openai_format import (
    ChoiceState,
    ResponseContext,
    chat_logprobs,
    completion_logprobs,
    usage_info,
)
from tpserve.server.http.reasoning import ReasoningSplit
from tpserve.server.http.replies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    UsageInfo,
)
from tpserve.server.http.tools import ToolPlan

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """Streams ``text/event-stream``; a client disconnect cancels the stream at once, and the
    body iterator is always closed, whichever ASGI spec version the server speaks."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _dump(chunk: CompletionChunk | ChatCompletionChunk, ctx: ResponseContext) -> bytes:
    return sse_event(chunk.model_dump(exclude=None if ctx.include_usage else {"usage"}))


def stream_error(exc: Exception) -> APIError:
    """What a client is told of ``exc`` raised mid-stream: an engine error as it is, any
    other as an internal error (logged here with its traceback)."""
    if isinstance(exc, EngineError):
        return APIError.from_engine(exc)
    logger.exception("error while streaming a response", exc_info=exc)
    return APIError(500, "Internal server error")


def _error_event(exc: Exception) -> bytes:
    return sse_event(stream_error(exc).body())


async def _all(first: RequestOutput, rest: AsyncIterator[RequestOutput]
               ) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


def _so_far(out: RequestOutput, ctx: ResponseContext) -> UsageInfo | None:
    """vLLM's ``continuous_usage_stats``: every chunk's usage so far (else none)."""
    return usage_info(out, ctx) if ctx.continuous_usage else None


def _has_content(delta: CompletionDelta, ctx: ResponseContext) -> bool:
    return (bool(delta.text) or bool(ctx.logprobs and delta.logprobs)
            or bool(ctx.prompt_ids is not None and delta.token_ids))


def _ids(delta: CompletionDelta, ctx: ResponseContext) -> list[int] | None:
    """A chunk's token ids (vLLM's ``return_token_ids``), else None."""
    return list(delta.token_ids) if ctx.prompt_ids is not None else None


async def completion_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                            ctx: ResponseContext) -> AsyncIterator[bytes]:
    """``/v1/completions`` chunks: text per delta, a finish chunk per choice, usage, [DONE].
    With ``echo`` a choice's first chunk is its prompt (with the scored prompt's logprobs),
    sent when its first delta arrives; an echo of the prompt alone sends no other text.
    With ``return_token_ids`` a choice's first chunk holds its prompt's ids and each chunk
    the ids of its tokens."""
    states = [ChoiceState() for _ in range(ctx.n)]
    echo = ctx.echo
    echoed = [False] * ctx.n
    started = [False] * ctx.n

    def chunk(choice: CompletionChoice, out: RequestOutput) -> bytes:
        if not started[choice.index]:
            started[choice.index] = True
            choice.prompt_token_ids = ctx.prompt_ids_of(choice.index)
        return _dump(CompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                                     choices=[choice], usage=_so_far(out, ctx)), ctx)

    try:
        final = None
        async for out in _all(first, outputs):
            for d in out.deltas:
                state = states[d.index]
                if echo is not None and not echoed[d.index]:
                    echoed[d.index] = True
                    text = echo.text(d.index)
                    lps = echo.logprobs(d.index, d.prompt_logprobs or ()) if ctx.logprobs \
                        else None
                    yield chunk(CompletionChoice(index=d.index, text=text, logprobs=lps), out)
                    state.text_offset += len(text)
                if echo is not None and echo.only:
                    d = replace(d, text="", logprobs=None, token_ids=())
                if _has_content(d, ctx):
                    lps = None
                    if ctx.logprobs:
                        lps = completion_logprobs(d.logprobs or (), state.text_offset)
                    yield chunk(CompletionChoice(index=d.index, text=d.text, logprobs=lps,
                                                 token_ids=_ids(d, ctx)), out)
                state.add(d)
                if d.finish_reason is not None:
                    yield chunk(CompletionChoice(index=d.index, text="",
                                                 finish_reason=d.finish_reason,
                                                 stop_reason=d.stop_reason), out)
            if out.finished:
                final = out
        if ctx.include_usage and final is not None:
            yield _dump(CompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                                        choices=[], usage=usage_info(final, ctx)), ctx)
    except Exception as exc:
        yield _error_event(exc)
    finally:
        await close_outputs(outputs)
    yield DONE


async def chat_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      ctx: ResponseContext) -> AsyncIterator[bytes]:
    """``/v1/chat/completions`` as server-sent events: ``chat_chunks``, then [DONE]; an
    error while streaming becomes an error event."""
    try:
        async for chunk in chat_chunks(first, outputs, ctx):
            yield _dump(chunk, ctx)
    except Exception as exc:
        yield _error_event(exc)
    finally:
        await close_outputs(outputs)
    yield DONE


async def chat_chunks(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      ctx: ResponseContext) -> AsyncIterator[ChatCompletionChunk]:
    """The chat chunks of one request: a role chunk per choice, content deltas, a finish
    chunk per choice, then (``include_usage``) one with the usage. With
    ``return_token_ids`` the first chunk holds the prompt's ids and each content chunk its
    tokens' (held tool-call output: the finish chunk holds them all); with
    ``return_prompt_text`` the first chunk holds the prompt as the template wrote it. With
    ``--reasoning-parser`` the reasoning goes out in ``reasoning`` deltas as it is decided
    (text that may yet be a tag is held), the answer as content, tool calls parsed from
    the answer alone. Raises what the engine raises; the caller closes ``outputs``."""

    def chunk(choice: ChatChunkChoice, out: RequestOutput, prompt_ids=None, prompt_text=None
              ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                                   choices=[choice], usage=_so_far(out, ctx),
                                   prompt_token_ids=prompt_ids, prompt_text=prompt_text)

    before = replace(first, deltas=[], num_output_tokens=0)  # the role chunks' usage
    held_ids: list[list[int]] = [[] for _ in range(ctx.n)]
    for j, i in enumerate(_choices(first, ctx)):
        yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role=ctx.role, content="")),
                    before, ctx.prompt_ids_of(0) if j == 0 else None,
                    ctx.prompt_text if j == 0 else None)
        if ctx.chat_echo:
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(content=ctx.chat_echo)),
                        before)
    final = None
    held = [_HeldChoice(ctx.tools) for _ in range(ctx.n)] if ctx.tools is not None \
        else None
    splits = [ReasoningSplit(ctx.reasoning) for _ in range(ctx.n)] \
        if ctx.reasoning is not None else None
    async for out in _all(first, outputs):
        for d in out.deltas:
            finish_reason = d.finish_reason
            if splits is not None:  # the reasoning goes out now; the answer goes on
                reasoning, d = _split_delta(splits[d.index], d, ctx)
                if reasoning is not None:
                    yield chunk(reasoning, out)
            if held is not None:
                held_ids[d.index].extend(d.token_ids)
                for delta, lps in held[d.index].add(d, ctx):
                    yield chunk(ChatChunkChoice(index=d.index, delta=delta, logprobs=lps), out)
                if finish_reason is not None:
                    finish_reason = held[d.index].finish_reason
            elif _has_content(d, ctx):
                lps = chat_logprobs(d.logprobs or ()) if ctx.logprobs else None
                yield chunk(ChatChunkChoice(index=d.index, delta=DeltaMessage(content=d.text),
                                            logprobs=lps, token_ids=_ids(d, ctx)), out)
            if finish_reason is not None:
                ids = held_ids[d.index] if held is not None and ctx.prompt_ids is not None \
                    else None
                yield chunk(ChatChunkChoice(index=d.index, delta=DeltaMessage(),
                                            finish_reason=finish_reason,
                                            stop_reason=d.stop_reason, token_ids=ids), out)
        if out.finished:
            final = out
    if ctx.include_usage and final is not None:
        yield ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model,
                                  choices=[], usage=usage_info(final))


def _choices(first: RequestOutput, ctx: ResponseContext) -> list[int]:
    """The indices of the stream's choices: all ``ctx.n``, unless the first output is the
    whole answer (a beam search's), which names every choice there is (a search may find
    fewer beams than ``n``; vLLM answers the beams found)."""
    if first.finished and first.deltas:
        return sorted({d.index for d in first.deltas})
    return list(range(ctx.n))


def _split_delta(split: ReasoningSplit, d: CompletionDelta, ctx: ResponseContext
                 ) -> tuple[ChatChunkChoice | None, CompletionDelta]:
    """The reasoning chunk of ``d`` (with its logprobs and ids), if it decides any
    reasoning the response includes, and ``d`` left with its answer text."""
    assert ctx.reasoning is not None
    reasoning, content = split.feed(d.text)
    if d.finish_reason is not None:
        more = split.finish()
        reasoning, content = reasoning + more[0], content + more[1]
    if not (reasoning and ctx.reasoning.include):
        return None, replace(d, text=content)
    lps = chat_logprobs(d.logprobs or ()) if ctx.logprobs else None
    choice = ChatChunkChoice(index=d.index, logprobs=lps, token_ids=_ids(d, ctx),
                             delta=DeltaMessage(reasoning=reasoning,
                                                reasoning_content=reasoning))
    return choice, replace(d, text=content, logprobs=None, token_ids=())


class _HeldChoice:
    """One choice of a stream whose output may hold tool calls (``ctx.tools``).

    Text the tool plan says is plain content (``ToolPlan.content_prefix_len``: none for
    constrained output) is sent as it comes. Where the plan streams calls
    (``ToolPlan.call_stream``: constrained output, and the JSON formats' parsers), each call's
    first delta (``index``, ``id``, ``type``, ``function.name``, empty
    ``function.arguments``) goes out as soon as its arguments begin, then their characters
    as the model writes them (``{"index", "function": {"arguments"}}``), as OpenAI streams
    them (``http/call_scanner.py``); when the choice finishes, the calls that could not
    stream follow whole. Otherwise the rest is held until the choice finishes, then parsed
    whole and sent as one delta: the remaining content, if any, and every tool call at once
    (each with its ``id``, ``type``, ``function.name`` and the complete
    ``function.arguments``). Logprobs of held tokens go with the next delta. A call the
    plan does not keep (``ToolPlan.keeps``: ``parallel_tool_calls`` false) sends nothing.
    """

    def __init__(self, tools: ToolPlan) -> None:
        self.plan = tools
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.calls = tools.call_stream()
        self.streamed: set[int] = set()  # the calls that went out as they were written

    def add(self, d: CompletionDelta, ctx: ResponseContext
            ) -> list[tuple[DeltaMessage, ChatLogprobs | None]]:
        assert ctx.tools is not None
        self.text += d.text
        if ctx.logprobs and d.logprobs:
            self.logprobs.extend(d.logprobs)
        out: list[tuple[DeltaMessage, ChatLogprobs | None]] = []
        # the content first (a delta may hold content, then calls, then the finish)
        upto = max(self.sent, ctx.tools.content_prefix_len(self.text))
        if upto > self.sent:
            out.append((DeltaMessage(content=self.text[self.sent:upto]), self._logprobs()))
            self.sent = upto
        if self.calls is not None:
            written = self._written_calls(d.text, d.finish_reason is not None)
            if written:
                out.append((DeltaMessage(tool_calls=written), self._logprobs()))
        if d.finish_reason is None:
            return out
        content, calls, self.finish_reason = ctx.tools.extract(self.text, d.finish_reason)
        if self.streamed and self.plan.mode == "auto":
            # a call went out: the choice ends as one that called tools, as vLLM's stream
            # ends it, even where a later call of the output does not parse
            self.finish_reason = "tool_calls"
        if self.streamed:  # the rest: calls that could not stream, held logprobs
            rest = [{"index": i, **call.model_dump()} for i, call in enumerate(calls)
                    if i not in self.streamed]
            if rest or self.logprobs:
                out.append((DeltaMessage(tool_calls=rest or None), self._logprobs()))
            self.sent = len(self.text)
            return out
        if calls:
            rest = (content or "")[self.sent:] or None
            out.append((DeltaMessage(content=rest, tool_calls=[
                {"index": i, **call.model_dump()} for i, call in enumerate(calls)]),
                self._logprobs()))
        elif len(self.text) > self.sent or self.logprobs:
            out.append((DeltaMessage(content=self.text[self.sent:]), self._logprobs()))
        self.sent = len(self.text)
        return out

    def _written_calls(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The tool-call deltas of ``text``, the output's next characters (``last``: its
        end)."""
        assert self.calls is not None
        deltas: list[dict[str, Any]] = []
        for e in [*self.calls.feed(text), *(self.calls.finish() if last else ())]:
            if not self.plan.keeps(e.index):
                continue
            if isinstance(e, CallStart):
                self.streamed.add(e.index)
                deltas.append({"index": e.index, "id": self.plan.call_id(), "type": "function",
                               "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, CallArguments):
                deltas.append({"index": e.index, "function": {"arguments": e.text}})
        return deltas

    def _logprobs(self) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        lps, self.logprobs = chat_logprobs(self.logprobs), []
        return lps

"""Engine outputs to OpenAI response objects: logprobs, usage, whole (non-stream) responses."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tpserve.server.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from tpserve.server.http.reasoning.split import ReasoningSplit
from tpserve.server.http.replies import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprobsList,
    PromptTokenLogprob,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

if TYPE_CHECKING:
    from tpserve.server.http.echo import Echo
    from tpserve.server.http.reasoning import ReasoningPlan
    from tpserve.server.http.tools import ToolPlan

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if not math.isnan(value) else LOGPROB_FLOOR


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


@dataclass(frozen=True)
class ResponseContext:
    """What every response or chunk of one request repeats."""

    id: str
    created: int
    model: str
    n: int
    logprobs: bool
    include_usage: bool = False
    continuous_usage: bool = False  # the usage so far in every stream chunk
    tools: ToolPlan | None = None  # set when tool calls are parsed from the output
    reasoning: ReasoningPlan | None = None  # --reasoning-parser (chat): the output's split
    echo: Echo | None = None       # completions with ``echo``
    prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs``: top alternatives
    chat_echo: str | None = None  # vLLM's chat ``echo``: the content every choice starts with
    # vLLM's ``return_token_ids``: each prompt's ids (choice i has prompt i // per_prompt)
    prompt_ids: tuple[list[int], ...] | None = None
    per_prompt: int = 1
    role: str = "assistant"  # chat: the answer's role (--response-role)
    prompt_text: str | None = None  # vLLM's chat ``return_prompt_text``: the rendered prompt

    def prompt_ids_of(self, choice: int) -> list[int] | None:
        return None if self.prompt_ids is None else self.prompt_ids[choice // self.per_prompt]


def usage_info(out: RequestOutput, ctx: ResponseContext | None = None) -> UsageInfo:
    """The request's usage; an echo of the prompt alone (``max_tokens: 0``) counts no
    completion tokens (the one the engine sampled is dropped)."""
    completion = 0 if ctx is not None and ctx.echo is not None and ctx.echo.only \
        else out.num_output_tokens
    return UsageInfo(prompt_tokens=out.num_prompt_tokens,
                     completion_tokens=completion,
                     total_tokens=out.num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def completion_logprobs(lps: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """Completions-API logprobs; ``text_offset`` is where the first token starts."""
    result = CompletionLogprobs()
    for lp in lps:
        top = {lp.text: clamp_logprob(lp.logprob)}
        for _, text, logprob in lp.top:
            top.setdefault(text, clamp_logprob(logprob))
        result.tokens.append(lp.text)
        result.token_logprobs.append(clamp_logprob(lp.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(lp.text)
    return result


def vllm_prompt_logprobs(scored: Sequence[TokenLogprob], top: int) -> PromptLogprobsList:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a dict
    by token id of the token itself (its rank) and its ``top`` alternatives (ranks 1..)."""
    out: PromptLogprobsList = [None]
    for lp in scored:
        entry = {str(lp.token_id): PromptTokenLogprob(logprob=clamp_logprob(lp.logprob),
                                                      rank=lp.rank, decoded_token=lp.text)}
        for rank, (token, text, logprob) in enumerate(lp.top[:top], start=1):
            entry.setdefault(str(token), PromptTokenLogprob(
                logprob=clamp_logprob(logprob), rank=rank, decoded_token=text))
        out.append(entry)
    return out


def _named_by_id(lps: tuple[TokenLogprob, ...] | None) -> tuple[TokenLogprob, ...] | None:
    if lps is None:
        return None
    return tuple(replace(lp, text=f"token_id:{lp.token_id}",
                         top=tuple((t, f"token_id:{t}", v) for t, _, v in lp.top))
                 for lp in lps)


async def tokens_named_by_id(outputs: AsyncIterator[RequestOutput]
                             ) -> AsyncIterator[RequestOutput]:
    """vLLM's ``return_tokens_as_token_ids``: every logprob token (and alternative) named
    ``token_id:<id>`` instead of its text. Closing this closes ``outputs``."""
    try:
        async for out in outputs:
            yield replace(out, deltas=[
                replace(d, logprobs=_named_by_id(d.logprobs),
                        prompt_logprobs=_named_by_id(d.prompt_logprobs))
                for d in out.deltas])
    finally:
        await outputs.aclose()


def chat_logprobs(lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.text, logprob=clamp_logprob(lp.logprob), bytes=_utf8(lp.text),
            top_logprobs=[TopLogprob(token=text, logprob=clamp_logprob(logprob),
                                     bytes=_utf8(text)) for _, text, logprob in lp.top])
        for lp in lps])


@dataclass
class ChoiceState:
    """Everything one sibling has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # the next token's completions text_offset: its tokens' text so far (the echo's
    # before them), as the whole answer counts it; not the text emitted, which a stop
    # string's hold-back delays
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the scored prompt (echo)
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: CompletionDelta) -> None:
        self.token_ids.extend(delta.token_ids)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text_parts.append(delta.text)
        self.text_offset += sum(len(lp.text) for lp in delta.logprobs or ())
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class OutputAccumulator:
    """Collects a whole request's outputs for a non-streaming response. ``answered`` are
    the choices some output named: every one of an engine request's (each sibling ends
    with a delta of its own), those a beam search found (it may find fewer beams than
    ``n``: vLLM answers the beams found)."""

    def __init__(self, n: int):
        self.choices = [ChoiceState() for _ in range(n)]
        self.named: set[int] = set()
        self.final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        for delta in out.deltas:
            self.choices[delta.index].add(delta)
            self.named.add(delta.index)
        if out.finished:
            self.final = out

    def answered(self) -> list[tuple[int, ChoiceState]]:
        """The named choices with their indices, in index order."""
        return [(i, c) for i, c in enumerate(self.choices) if i in self.named]

    def usage(self, ctx: ResponseContext | None = None) -> UsageInfo | None:
        return usage_info(self.final, ctx) if self.final is not None else None


def _completion_choice(i: int, c: ChoiceState, ctx: ResponseContext) -> CompletionChoice:
    echo = ctx.echo
    text, lps, ids = c.text, c.logprobs, c.token_ids
    if echo is not None and echo.only:
        text, lps, ids = "", [], []
    logprobs = None
    if ctx.logprobs:
        logprobs = completion_logprobs(lps, 0)
    if echo is not None:
        prefix = echo.text(i)
        if ctx.logprobs:
            logprobs = echo.joined_with(i, c.prompt_logprobs, lps)
        text = prefix + text
    prompt = None
    if ctx.prompt_logprobs is not None:
        prompt = vllm_prompt_logprobs(c.prompt_logprobs, ctx.prompt_logprobs)
    prompt_ids = ctx.prompt_ids_of(i)
    return CompletionChoice(index=i, text=text, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason, logprobs=logprobs, prompt_logprobs=prompt,
                            prompt_token_ids=prompt_ids,
                            token_ids=list(ids) if prompt_ids is not None else None)


def completion_response(acc: OutputAccumulator, ctx: ResponseContext) -> CompletionResponse:
    choices = [_completion_choice(i, c, ctx) for i, c in acc.answered()]
    return CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model,
                              choices=choices, usage=acc.usage(ctx))


def _chat_choice(i: int, c: ChoiceState, ctx: ResponseContext) -> ChatChoice:
    content: str | None = c.text
    reasoning = None
    calls: list = []
    finish_reason = c.finish_reason
    if ctx.reasoning is not None:
        reasoning, content = ReasoningSplit.whole(ctx.reasoning, c.text)
        if not ctx.reasoning.include:
            reasoning = None
    if ctx.tools is not None and content is not None:  # calls are in the answer only
        content, calls, finish_reason = ctx.tools.extract(content, c.finish_reason)
    if ctx.chat_echo:
        content = ctx.chat_echo + (content or "")
    message = ChatResponseMessage(role=ctx.role, content=content, reasoning=reasoning,
                                  reasoning_content=reasoning, tool_calls=calls)
    return ChatChoice(index=i, message=message,
                      finish_reason=finish_reason, stop_reason=c.stop_reason,
                      logprobs=chat_logprobs(c.logprobs) if ctx.logprobs else None,
                      token_ids=list(c.token_ids) if ctx.prompt_ids is not None else None)


def chat_response(acc: OutputAccumulator, ctx: ResponseContext) -> ChatCompletionResponse:
    choices = [_chat_choice(i, c, ctx) for i, c in acc.answered()]
    prompt = None
    if ctx.prompt_logprobs is not None:  # one prompt: the first choice's scored prompt
        prompt = vllm_prompt_logprobs(acc.choices[0].prompt_logprobs, ctx.prompt_logprobs)
    return ChatCompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model,
                                  choices=choices, usage=acc.usage(), prompt_logprobs=prompt,
                                  prompt_token_ids=ctx.prompt_ids_of(0),
                                  prompt_text=ctx.prompt_text)

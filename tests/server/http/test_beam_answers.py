"""An answer holds the choices its outputs name: a beam search (one finished output) may
find fewer beams than ``n``, and its whole answer and its chat stream then hold those
beams alone, at their own indices; an engine request's stream still opens every choice
before its first tokens."""

from __future__ import annotations

import asyncio

from tpserve.server.engine.outputs import CompletionDelta, RequestOutput
from tpserve.server.http.openai_format import (
    OutputAccumulator,
    ResponseContext,
    chat_response,
    completion_response,
)
from tpserve.server.http.streaming import chat_chunks


def _ctx(n: int) -> ResponseContext:
    return ResponseContext(id="x", created=0, model="m", n=n, logprobs=False)


def _found(*indices: int) -> RequestOutput:
    """A beam search's one output: a finished beam at each of ``indices``."""
    return RequestOutput("r", [CompletionDelta(i, f"b{i}", (i,), finish_reason="length")
                               for i in indices], num_prompt_tokens=1,
                         num_output_tokens=len(indices), finished=True)


def _chunks(first: RequestOutput, ctx: ResponseContext, rest=()) -> list:
    async def outputs():
        for out in rest:
            yield out

    async def run():
        return [c async for c in chat_chunks(first, outputs(), ctx)]
    return asyncio.run(run())


def test_a_whole_answer_holds_the_choices_named_at_their_indices():
    acc = OutputAccumulator(6)
    acc.add(_found(0, 1, 3))
    completion = completion_response(acc, _ctx(6))
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, "b0", "length"), (1, "b1", "length"), (3, "b3", "length")]
    chat = chat_response(acc, _ctx(6))
    assert [(c.index, c.message.content) for c in chat.choices] == [
        (0, "b0"), (1, "b1"), (3, "b3")]


def test_a_chat_stream_of_one_finished_output_opens_only_its_choices():
    chunks = _chunks(_found(0, 1), _ctx(4))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                if c.choices[0].finish_reason]
    assert roles == [0, 1]
    assert finishes == [(0, "length"), (1, "length")]


def test_an_engine_requests_stream_opens_every_choice_first():
    first = RequestOutput("r", [CompletionDelta(0, "a", (5,))])
    rest = [RequestOutput("r", [CompletionDelta(0, "", (), finish_reason="stop"),
                                CompletionDelta(1, "b", (6,), finish_reason="stop")],
                          finished=True)]
    chunks = _chunks(first, _ctx(2), rest)
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:2])

"""vLLM's ``stream_interval`` (the request field) and ``--stream-interval`` (the server's
floor): a stream's outputs batched so that a chunk carries at least that many new tokens
of some choice. The first output and the last go out at once, as in vLLM; nothing is
held back by time, only by count, so an interval of 1 (the default) changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from tpserve.server.engine.outputs import CompletionDelta, RequestOutput
from tpserve.server.http.generation import close_outputs


def merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output holding ``first``'s deltas then ``later``'s, a choice's consecutive
    deltas joined (text, tokens and logprobs in order; the later finish; the earlier
    prompt logprobs); counts, state and error from ``later``."""
    deltas = {d.index: d for d in first.deltas}
    for d in later.deltas:
        before = deltas.get(d.index)
        deltas[d.index] = d if before is None else _joined(before, d)
    return replace(later, deltas=list(deltas.values()))


def _joined(a: CompletionDelta, b: CompletionDelta) -> CompletionDelta:
    logprobs = None if a.logprobs is None and b.logprobs is None else \
        (a.logprobs or ()) + (b.logprobs or ())
    return replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                   logprobs=logprobs, prompt_logprobs=a.prompt_logprobs
                   if a.prompt_logprobs is not None else b.prompt_logprobs)


def _most_new_tokens(out: RequestOutput) -> int:
    return max((len(d.token_ids) for d in out.deltas), default=0)


async def batched(outputs: AsyncIterator[RequestOutput], interval: int
                  ) -> AsyncIterator[RequestOutput]:
    """``outputs`` with every output after the first merged into the next until one of
    its choices has ``interval`` new tokens, or the request finished (or failed: an error
    output goes out at once). Closes ``outputs`` however this ends."""
    held: RequestOutput | None = None
    first = True
    try:
        async for out in outputs:
            held = out if held is None else merged(held, out)
            if first or held.finished or held.error or _most_new_tokens(held) >= interval:
                ready, held, first = held, None, False
                yield ready
        if held is not None:
            yield held
    finally:
        await close_outputs(outputs)

"""Several prompts of one completions request, answered as one request.

Each prompt runs as its own engine request; their outputs are merged into one stream of
``RequestOutput``: sibling ``i`` of prompt ``k`` becomes choice ``k * n + i``, usage is
summed over the prompts, and the merged output is finished once every prompt's is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from tpserve.server.engine.outputs import RequestOutput

_END = object()


async def merged_outputs(request_id: str, streams: Sequence[AsyncIterator[RequestOutput]],
                         n: int) -> AsyncIterator[RequestOutput]:
    """The outputs of ``streams`` (one per prompt, ``n`` choices each) as one request's.
    The first error of any stream ends the merged stream with it; closing the merged
    stream closes (and so aborts) every prompt's stream."""
    queue: asyncio.Queue = asyncio.Queue()
    latest: list[RequestOutput | None] = [None] * len(streams)

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((k, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((k, exc))
            return
        await queue.put((k, _END))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            k, item = await queue.get()
            if item is _END:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            latest[k] = item
            done = [o for o in latest if o is not None]
            yield RequestOutput(
                request_id, [replace(d, index=k * n + d.index) for d in item.deltas],
                num_prompt_tokens=sum(o.num_prompt_tokens for o in done),
                num_output_tokens=sum(o.num_output_tokens for o in done),
                num_cached_tokens=sum(o.num_cached_tokens for o in done),
                finished=len(done) == len(streams) and all(o.finished for o in done))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

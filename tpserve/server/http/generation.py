"""Driving one engine request from the HTTP layer: metrics, early abort, client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.errors import EngineError
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.http.access_log import AccessRecord
from tpserve.server.http.engine_client import EngineClient
from tpserve.server.http.http_errors import ClientDisconnected
from tpserve.server.http.metrics import RequestTracker
from tpserve.server.http.request_log import OutputLog, RequestLog, log_request

T = TypeVar("T")


def engine_outputs(engine: EngineClient, request_id: str, prompt_ids: list[int],
                   params: SamplingParams, tracker: RequestTracker,
                   record: AccessRecord | None = None, log: RequestLog | None = None
                   ) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, ending with the finished one (``tracked``),
    the request logged as ``log`` says (``request_log.py``; None: not).

    Stopping early (``aclose()``, cancellation, an error output) closes the engine's
    generator; the engine aborts the request then, exactly once (``EngineClient``): the
    engine is the one owner of abort.
    """
    output_log = None if log is None else log_request(log, request_id, prompt_ids, params,
                                                      engine.tokenizer)
    return tracked(engine.generate(request_id, prompt_ids, params), request_id, tracker,
                   record, output_log)


async def tracked(outputs: AsyncIterator[RequestOutput], request_id: str,
                  tracker: RequestTracker, record: AccessRecord | None = None,
                  output_log: OutputLog | None = None) -> AsyncIterator[RequestOutput]:
    """``outputs`` (one request's: the engine's, or a beam search's) up to the finished
    one, each observed by ``tracker`` (and ``output_log``); the finished one's token counts
    go into ``record`` for the access log. An error output raises ``EngineError``;
    ``outputs`` is closed however this ends."""
    try:
        async for out in outputs:
            if out.error:
                raise EngineError(out.error)
            tracker.on_output(out)
            if output_log is not None:
                output_log.on_output(out)
            if out.finished and record is not None:  # summed over the prompts of a request
                record.prompt_tokens = (record.prompt_tokens or 0) + out.num_prompt_tokens
                record.completion_tokens = ((record.completion_tokens or 0)
                                            + out.num_output_tokens)
            yield out
            if out.finished:
                return
        raise EngineError(f"engine stopped request {request_id} before it finished")
    finally:
        await close_outputs(outputs)


async def close_outputs(outputs: AsyncIterator[RequestOutput]) -> None:
    """Closes ``outputs`` (an async generator's ``aclose``; other iterators need none)."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is not None:
        await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; if the client disconnects first, cancels it and raises
    ``ClientDisconnected``. Call only after the request body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    disconnected = not task.done()
    if disconnected:
        task.cancel()
    # Let both finish their cleanup (the cancelled work aborts the engine request).
    await asyncio.gather(task, watcher, return_exceptions=True)
    if disconnected:
        raise ClientDisconnected()
    return task.result()

"""Sending the plans: ``SoakSender`` classifies how each request ended (never raising),
``run_plans`` keeps ``concurrency`` in flight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from tpserve.loadtest.soak.outcomes import (
    ABORTED,
    ERRORED,
    FAILED,
    Outcome,
    StreamCheck,
    check_whole,
    clip,
    envelope_message,
    error_outcome,
)
from tpserve.loadtest.soak.plans import RequestPlan
from tpserve.loadtest.sse import iter_events


class SoakSender:
    """Sends RequestPlans and classifies how each ended; never raises but CancelledError."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, timeout: float):
        self._client = client
        self._base_url = base_url
        self._model = model
        self._timeout = timeout

    async def send(self, plan: RequestPlan) -> Outcome:
        cancel_at = plan.abort_after_s
        limit = self._timeout if cancel_at is None else min(cancel_at, self._timeout)
        try:
            return await asyncio.wait_for(self._attempt(plan), limit)
        except asyncio.TimeoutError:
            if cancel_at is not None and cancel_at < self._timeout:
                return Outcome(ABORTED, f"request task cancelled after {cancel_at:.2f}s")
            return Outcome(FAILED, f"no complete answer within {self._timeout:g}s (hang)")
        except httpx.TimeoutException as e:
            return Outcome(FAILED, f"timeout ({type(e).__name__})")
        except httpx.HTTPError as e:
            return Outcome(FAILED, clip(f"transport error {type(e).__name__}: {e}"))
        except Exception as e:  # anything else is a failure of the soak, never a crash
            return Outcome(FAILED, clip(f"{type(e).__name__}: {e}"))

    async def _attempt(self, plan: RequestPlan) -> Outcome:
        url = self._base_url + plan.path()
        async with self._client.stream("POST", url, json=plan.body(self._model)) as response:
            if response.status_code != 200:
                return error_outcome(response.status_code, await response.aread())
            if plan.stream:
                return await self._read_stream(plan, response)
            raw = await response.aread()
        return check_whole(plan, raw)

    async def _read_stream(self, plan: RequestPlan, response: httpx.Response) -> Outcome:
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            return Outcome(FAILED, f"stream answered with content-type {content_type!r}")
        check = StreamCheck(plan)
        events = 0
        async for event in iter_events(response.aiter_lines()):
            if plan.abort_after_events is not None and events >= plan.abort_after_events:
                return Outcome(ABORTED, f"stream closed by the client after {events} events")
            events += 1
            data = event.data.strip()
            if data == "[DONE]":
                return check.at_done()
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                return Outcome(FAILED, clip(f"malformed stream chunk: {data[:200]!r}"))
            if event.event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                message = envelope_message(chunk)
                if message is None:
                    return Outcome(FAILED, clip(f"error event without the envelope: {data!r}"))
                return Outcome(ERRORED, clip(f"SSE error event: {message}"))
            problem = check.add(chunk)
            if problem is not None:
                return Outcome(FAILED, clip(problem))
        if plan.abort_after_events is not None and events >= plan.abort_after_events:
            return Outcome(ABORTED, f"stream closed by the client after {events} events")
        return Outcome(FAILED, f"stream ended after {events} events without [DONE] or an "
                               "error event")


async def run_plans(sender: SoakSender, plans: list[RequestPlan], concurrency: int,
                    on_done: Callable[[int], None] | None = None) -> list[Outcome]:
    """Send every plan with at most ``concurrency`` in flight; outcomes in plan order."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    position = 0
    done = 0

    async def worker() -> None:
        nonlocal position, done
        while position < len(plans):
            i = position
            position += 1
            outcomes[i] = await sender.send(plans[i])
            done += 1
            if on_done is not None:
                on_done(done)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(plans)))))
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None]

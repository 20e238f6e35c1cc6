"""Server-sent events: turn a stream of text lines into (event, data) pairs."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event; ``event`` is "message" unless the server named it."""

    data: str
    event: str = "message"


async def iter_events(lines: AsyncIterable[str]) -> AsyncIterator[SSEEvent]:
    """Yield the events of an SSE stream given its lines (without line terminators).

    Follows the SSE rules that matter here: ``data:`` lines accumulate (joined with
    newlines) until a blank line dispatches them; ``event:`` names the event; comment
    lines (``:``) and other fields are ignored; a final event without a trailing blank
    line is still dispatched.
    """
    data: list[str] = []
    event = "message"
    async for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                yield SSEEvent(data="\n".join(data), event=event)
            data, event = [], "message"
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value or "message"
    if data:
        yield SSEEvent(data="\n".join(data), event=event)

"""What every tool-call parser returns, and the checks they share."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpserve.server.http.call_scanner import CallStream, held_suffix


def new_call_id() -> str:
    """A tool call's id, as OpenAI writes them (``call_`` and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """``content`` is the text outside the calls (None when there is none)."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


def as_call(obj: Any, *argument_keys: str) -> ParsedCall | None:
    """A call from a decoded JSON object ``{"name": str, KEY: object}`` where KEY is the
    first of ``argument_keys`` present (missing: no arguments, ``{}``); None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def all_calls(text: str, at: int, bodies: Sequence[Any],
              parse: Callable[[Any], ParsedCall | None]) -> ExtractedToolCalls:
    """Each of ``bodies`` (the calls as the format writes them) ``parse``d, the text before
    ``at`` (where the calls start) as content; the whole text as content when ``at`` is
    negative (no calls), there are no bodies, or any body does not parse."""
    calls = [parse(body) for body in bodies]
    if at < 0 or not calls or any(c is None for c in calls):
        return ExtractedToolCalls(text)
    return ExtractedToolCalls(text[:at] or None, calls)  # type: ignore[arg-type]


class ToolParser:
    """Parses one output format. ``extract`` reads a whole output; ``content_prefix_len``
    says how much of a partial output is certainly plain content (streaming sends that
    much at once and holds the rest until the output ends)."""

    # whether the format's marker is a special token the detokenizer must keep
    needs_special_tokens: bool = False

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        """``tools``: the request's tools as its template sees them (OpenAI's ``{"type":
        "function", "function": {...}}``), for formats whose arguments are typed by them."""
        raise NotImplementedError

    def content_prefix_len(self, text: str) -> int:
        raise NotImplementedError

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> CallStream | None:
        """What reads this format's calls as they are written, from its first marker on
        (None: its calls are sent whole when the output ends); ``tools`` as ``extract``
        takes them."""
        return None

    def call_id(self) -> str:
        """A new id for one of this format's calls, whole or streamed (the model's chat
        template reads it back on the next turn, and some templates insist on a form)."""
        return new_call_id()


class MarkerToolParser(ToolParser):
    """A format whose calls follow a start marker; text before it is plain content."""

    marker: str = ""

    def calls_in(self, text: str, bodies: Sequence[Any],
                 parse: Callable[[Any], ParsedCall | None]) -> ExtractedToolCalls:
        """``all_calls`` with the content before the first marker."""
        return all_calls(text, text.find(self.marker), bodies, parse)

    def content_prefix_len(self, text: str) -> int:
        at = text.find(self.marker)
        if at >= 0:
            return at
        return len(text) - held_suffix(text, self.marker)

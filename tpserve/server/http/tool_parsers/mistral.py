"""Mistral format (vLLM's ``mistral`` parser); text before the first ``[TOOL_CALLS]`` is
content. Two forms, which the first non-blank character after that marker tells apart
(``[`` or ``{``: the first):

- models of tokenizers before v11: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
  (a single object is accepted too), one JSON value read from the marker on, what follows
  it ignored (as vLLM decodes the first value there);
- v11 and later (Mistral Small 3.2, Magistral, Devstral, ...): each call after its own
  marker, ``[TOOL_CALLS]NAME[ARGS]{...}``, ``[ARGS]`` optional (``NAME{...}``), an optional
  ``[CALL_ID]ID`` after the name (the model's ids are not kept: the server gives each call
  its own, ``call_id``); text between a call's arguments and the next marker is ignored.
  vLLM reads this form on its Mistral-tokenizer path and on a Hugging Face tokenizer that
  has ``[ARGS]``; a name holding blanks, or arguments that are no JSON object, make the
  whole output content here (vLLM returns such calls as they are).

Call ids are 9 letters and digits: Mistral's chat templates refuse any other id when the
client sends the calls back (vLLM's ``MistralToolCall``). ``[TOOL_CALLS]`` is a special
token, so requests parsed with this format keep special tokens in the output."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import (
    AfterMarker,
    CallArguments,
    CallEnd,
    CallEvent,
    CallStart,
    held_suffix,
)
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    MarkerToolParser,
    ParsedCall,
    as_call,
)

MARKER = "[TOOL_CALLS]"
CALL_ID, ARGS = "[CALL_ID]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


def _json_form(after_marker: str) -> bool:
    return after_marker.lstrip()[:1] in ("[", "{")


class MistralCalls:
    """Mistral calls read as they are written (``call_scanner.CallStream``). The JSON form
    goes to an ``AfterMarker`` (its calls held until they close and parse); a v11 call is
    read whole: once its arguments' object closes, its start, its arguments as written
    and its end go out together if they are a JSON object. Text the format does not
    allow where a call goes (a name with blanks, no ``{`` after the name, arguments
    that do not parse) ends the reading (``broken``: the whole output is content)."""

    def __init__(self) -> None:
        self.pending = ""
        self.json: AfterMarker | None = None  # the JSON form's reader
        self.stage = "marker"  # marker (the first), name, id, open, args, between
        self.name = ""
        self.arguments = _ObjectEnd()  # where the current call's arguments end
        self.calls = 0
        self.broken = False

    @property
    def complete(self) -> bool:
        """Whether the output, if it ended now, leaves no call unfinished."""
        return not self.broken and (self.stage in ("marker", "between") or (
            self.stage == "name" and not self.pending.strip()))

    def feed(self, text: str) -> list[CallEvent]:
        if self.json is not None:
            return self.json.feed(text)
        self.pending += text
        events: list[CallEvent] = []
        while not self.broken and self.json is None and self._step(events):
            pass
        return events

    def finish(self) -> list[CallEvent]:
        return []  # a call whose arguments the output leaves open is no call

    def _step(self, events: list[CallEvent]) -> bool:
        """Reads one element off ``pending``; False when it needs more text."""
        if self.stage in ("marker", "between"):
            at = self.pending.find(MARKER)
            if at < 0:
                self.pending = self.pending[len(self.pending)
                                            - held_suffix(self.pending, MARKER):]
                return False
            after = self.pending[at + len(MARKER):]
            if self.stage == "marker":
                if not after.strip():
                    return False  # the form is not told yet
                if _json_form(after):
                    self.json = AfterMarker((MARKER,), ("arguments",), then="")
                    events += self.json.feed(self.pending[at:])
                    return False
            self.pending, self.stage, self.name = after, "name", ""
            return True
        if self.stage == "open":
            body = self.pending.lstrip()
            if not body:
                return False
            if body[0] != "{":
                self.broken = True
                return False
            self._arguments(body)
            return True
        if self.stage == "args":
            end = self.arguments.of(self.pending)
            if end is None:
                return False
            self._call(self.pending[:end], events)
            self.pending, self.stage = self.pending[end:], "between"
            return True
        return self._head()

    def _head(self) -> bool:
        """The name (stage ``name``) or the model's call id (``id``), up to ``[CALL_ID]``
        (after a name), ``[ARGS]`` or the arguments' ``{``."""
        cut = min((i for i in (self.pending.find("["), self.pending.find("{")) if i >= 0),
                  default=-1)
        if cut < 0:
            return False
        if self.stage == "name":
            self.name = self.pending[:cut].strip()
            if not self.name or any(c.isspace() for c in self.name):
                self.broken = True
                return False
        rest = self.pending[cut:]
        markers = (CALL_ID, ARGS) if self.stage == "name" else (ARGS,)
        if rest[0] == "{":
            self._arguments(rest)
        elif (found := next((m for m in markers if rest.startswith(m)), None)) is not None:
            self.pending, self.stage = rest[len(found):], "id" if found == CALL_ID else "open"
        elif any(m.startswith(rest) for m in markers):
            return False  # a marker's beginning
        else:
            self.broken = True
            return False
        return True

    def _arguments(self, text: str) -> None:
        """The arguments' object opens ``text``."""
        self.pending, self.stage, self.arguments = text, "args", _ObjectEnd()

    def _call(self, arguments: str, events: list[CallEvent]) -> None:
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            self.broken = True
            return
        events += [CallStart(self.calls, self.name), CallArguments(self.calls, arguments),
                   CallEnd(self.calls, True, self.name, None)]
        self.calls += 1


class _ObjectEnd:
    """Where the JSON object opening a text ends, the text given as it grows (each
    character read once). Only strings and nesting are followed: whether the object
    parses is the caller's."""

    def __init__(self) -> None:
        self.read = 0
        self.depth = 0
        self.in_string = False
        self.escape = False

    def of(self, text: str) -> int | None:
        """The end of the object (after its ``}``) opening ``text``; None while open."""
        for i in range(self.read, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.read = len(text)
        return None


class MistralToolParser(MarkerToolParser):
    marker = MARKER
    needs_special_tokens = True

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> MistralCalls:
        return MistralCalls()

    def call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        at = text.find(self.marker)
        if at < 0:
            return ExtractedToolCalls(text)
        after = text[at + len(self.marker):]
        if not _json_form(after):
            return self._named_calls(text, at)
        try:
            decoded, _ = json.JSONDecoder().raw_decode(text, len(text) - len(after.lstrip()))
        except ValueError:
            return ExtractedToolCalls(text)
        items = decoded if isinstance(decoded, list) else [decoded]
        return self.calls_in(text, items, lambda item: as_call(item, "arguments"))

    def _named_calls(self, text: str, at: int) -> ExtractedToolCalls:
        """The v11 form's calls, read as the stream reads them; all of them or none."""
        reader = MistralCalls()
        events = reader.feed(text) + reader.finish()
        calls = [ParsedCall(e.name, "") for e in events if isinstance(e, CallStart)]
        for e in events:
            if isinstance(e, CallArguments):
                calls[e.index] = ParsedCall(calls[e.index].name, e.text)
        if not calls or not reader.complete:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(text[:at] or None, calls)

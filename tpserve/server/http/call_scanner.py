"""Tool calls read as they are written: the JSON text of calls ``{"name": ..., KEY:
{...}}``, fed piece by piece, gives each call's name as soon as its arguments begin, then
the arguments' own characters, unchanged, as they come. Streamed tool calls are built from
it (``http/streaming.py``), and so are whole answers' calls, so that a call's streamed
argument deltas add up to exactly the arguments of the same answer whole.

``MarkedCalls`` does the same for calls written between markers (Hermes'
``<tool_call>...</tool_call>``), feeding the scanner only what lies between them;
``AfterMarker`` for calls written after a marker (Mistral's ``[TOOL_CALLS]``, ...) or
from the output's start. Both read free output (``tool_choice: auto``), whose JSON may not
parse, so each holds a streamable call back until it closes and reports it only if its
arguments parse (``ParsedCalls``): a stream never sends arguments that are not JSON, nor a
call that the output leaves open.

Invariants: the scanner is fed every character once, in order; a call is *streamable*
when its name is known before its arguments begin and the arguments are a JSON object;
the arguments of a streamable call are the characters from its opening ``{`` to the
matching ``}``, both included; any other call is reported whole when it closes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

_SPACE = " \t\r\n"


class CallStart(NamedTuple):
    """A streamable call's arguments began: its number among the calls and its name."""

    index: int
    name: str


class CallArguments(NamedTuple):
    """More characters of call ``index``'s arguments."""

    index: int
    text: str


class CallEnd(NamedTuple):
    """Call ``index`` closed. ``streamed``: its start and arguments were reported;
    otherwise ``name`` and ``arguments`` (its raw JSON value, or None when it has
    none) are the whole call, or ``name`` is None when it is no call at all."""

    index: int
    streamed: bool
    name: str | None
    arguments: str | None


CallEvent = CallStart | CallArguments | CallEnd


@dataclass
class _Call:
    index: int
    name: str | None = None
    key: str | None = None  # the key whose value comes next (after its ':')
    last_string: str | None = None  # the last string closed at the call's depth
    streaming: bool = False  # inside the arguments of a streamable call
    streamed: bool = False
    raw: list[str] = field(default_factory=list)  # the arguments' characters
    raw_open: bool = False  # the arguments value began and has not ended


class CallScanner:
    """Reads calls at nesting ``depth`` (1: the text is one call object; 2: an array of
    them) whose arguments are under the first of ``argument_keys`` present.

    ``then`` says what the text may hold outside its top-level values (the call objects
    at depth 1, the arrays at depth 2): None, anything (read on); ``""``: one value,
    blanks before it, nothing read after it; ``";"``: values one after another, each
    after blanks and at most one ``;``. With ``then`` set, a character outside a value
    that it does not allow ends the reading (``ended``): the rest of the text is no
    call."""

    def __init__(self, depth: int, argument_keys: tuple[str, ...], then: str | None = None):
        self.call_depth = depth
        self.argument_keys = argument_keys
        self.then = then
        self.ended = False
        self.values = 0  # top-level values closed
        self.separated = False  # a ';' came since the last value closed
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.string: list[str] | None = None  # a string being read at the call's depth
        self.call: _Call | None = None
        self.calls = 0

    def finish(self) -> list[CallEvent]:
        return []  # a JSON call left open is no call

    def feed(self, text: str) -> list[CallEvent]:
        events: list[CallEvent] = []
        for ch in text:
            self._char(ch, events)
        if self.call is not None and self.call.streaming:
            self._flush(self.call, events)
        return events

    def _char(self, ch: str, events: list[CallEvent]) -> None:
        if self.ended or (self.then is not None and self.depth == 0
                          and not self._opens_value(ch)):
            return
        call = self.call
        if self.in_string:
            self._string_char(ch, call)
            return
        if call is not None and call.key is not None and ch not in _SPACE \
                and self.depth == self.call_depth:
            self._value_begins(ch, call, events)
        if ch == '"':
            self.in_string = True
            self.string = [] if call is not None and self.depth == self.call_depth else None
        elif ch in "{[":
            if ch == "{" and self.depth == self.call_depth - 1:
                call = self.call = _Call(self.calls)
                self.calls += 1
                self.depth += 1
                return
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.values += 1
                self.separated = False
            if call is not None and call.raw_open and self.depth == self.call_depth:
                call.raw.append(ch)  # the arguments' closing brace
                self._arguments_end(call, events)
                return
            if call is not None and self.depth == self.call_depth - 1:
                self._arguments_end(call, events)
                self._close(call, events)
                return
        elif ch == ":" and call is not None and self.depth == self.call_depth:
            call.key, call.last_string = call.last_string, None
            return
        elif ch == "," and call is not None and self.depth == self.call_depth:
            self._arguments_end(call, events)
            return
        if call is not None and call.raw_open:
            call.raw.append(ch)

    def _opens_value(self, ch: str) -> bool:
        """With ``then`` set, whether ``ch`` (outside any value) opens the next value;
        otherwise it is skipped (a blank, an allowed ``;``) or ends the reading."""
        if ch in _SPACE:
            return False
        if ch == "{["[self.call_depth - 1] and (self.values == 0 or self.then == ";"):
            return True
        if ch == ";" and self.then == ";" and self.values and not self.separated:
            self.separated = True
            return False
        self.ended = True
        return False

    def _string_char(self, ch: str, call: _Call | None) -> None:
        if call is not None and call.raw_open:
            call.raw.append(ch)
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            if self.string is not None and call is not None:
                text, self.string = "".join(self.string), None
                if call.key is None:
                    call.last_string = text
                else:  # a string value at the call's depth
                    if call.key == "name" and call.name is None:
                        call.name = text
                    call.key = None
            return
        if self.string is not None:
            self.string.append(ch)

    def _value_begins(self, ch: str, call: _Call, events: list[CallEvent]) -> None:
        if call.key in self.argument_keys and not call.raw_open and not call.raw:
            call.raw_open = True
            if ch == "{" and call.name is not None and not call.streamed:
                call.streaming = call.streamed = True
                events.append(CallStart(call.index, call.name))
        if ch != '"':  # a string value clears the key when it closes
            call.key = None

    def _arguments_end(self, call: _Call, events: list[CallEvent]) -> None:
        if not call.raw_open:
            return
        call.raw_open = False
        if call.streaming:
            self._flush(call, events)
            call.streaming = False

    def _flush(self, call: _Call, events: list[CallEvent]) -> None:
        """A streaming call's arguments kept since the last flush, as one event."""
        if call.raw:
            events.append(CallArguments(call.index, "".join(call.raw)))
            call.raw.clear()

    def _close(self, call: _Call, events: list[CallEvent]) -> None:
        if call.streamed:
            events.append(CallEnd(call.index, True, call.name, None))
        else:
            raw = "".join(call.raw).strip() if call.raw else None
            events.append(CallEnd(call.index, False, call.name, raw))
        self.call = None


class ParsedCalls:
    """Holds back each streamable call's events (its start, its arguments) until the call
    closes, then passes them on, the arguments in one piece as written, if those parse as
    a JSON object; otherwise nothing of the call is passed on.
    Invariant: a streamable call's start and arguments are passed on together with its
    end, or never (a call left open is held forever); every other event is passed on as
    it comes."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[str, list[str]]] = {}  # by index: name, arguments

    def passed(self, events: list[CallEvent]) -> list[CallEvent]:
        out: list[CallEvent] = []
        for e in events:
            if isinstance(e, CallStart):
                self.held[e.index] = (e.name, [])
            elif isinstance(e, CallArguments):
                self.held[e.index][1].append(e.text)
            elif e.streamed:
                name, pieces = self.held.pop(e.index)
                out += _checked(e.index, name, "".join(pieces))
            else:
                out.append(e)
        return out


def _checked(index: int, name: str, arguments: str) -> list[CallEvent]:
    """A held call's events: all of them if ``arguments`` (a streamable call's: from its
    ``{`` to the matching ``}``) parse, which makes them a JSON object, else none."""
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        return []
    return [CallStart(index, name), CallArguments(index, arguments),
            CallEnd(index, True, name, None)]


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkedCalls:
    """Calls written as JSON objects between ``start`` and ``end`` markers, one a region,
    read as they are written: the text between the markers goes to a ``CallScanner``
    (arguments under the first of ``argument_keys``), the markers and the text around them
    nowhere. A region the output leaves open is read to the end. Streamable calls are
    reported when they close (``ParsedCalls``)."""

    def __init__(self, start: str, end: str, argument_keys: tuple[str, ...]):
        self.scanner = CallScanner(1, argument_keys)
        self.parsed = ParsedCalls()
        self.markers = (start, end)
        self.inside = False
        self.pending = ""  # text that may be the beginning of the next marker

    def finish(self) -> list[CallEvent]:
        return []  # a JSON call left open is no call

    def feed(self, text: str) -> list[CallEvent]:
        self.pending += text
        events: list[CallEvent] = []
        while True:
            marker = self.markers[self.inside]
            at = self.pending.find(marker)
            if at < 0:
                cut = len(self.pending) - held_suffix(self.pending, marker)
                if self.inside:
                    events += self.scanner.feed(self.pending[:cut])
                self.pending = self.pending[cut:]
                return self.parsed.passed(events)
            if self.inside:
                events += self.scanner.feed(self.pending[:at])
            self.pending = self.pending[at + len(marker):]
            self.inside = not self.inside


class AfterMarker:
    """Calls written as JSON after a marker (the first of ``markers`` found; with
    ``anywhere`` false only at the output's start, after blanks), or, with ``bare``, from
    the output's start when its first non-blank character is ``bare``: one object, objects
    one after another, or an array of them (which, the first character after the marker
    says; with ``then`` ``";"`` always objects). The text before goes nowhere; what may
    come after is ``then``'s (``CallScanner``). Streamable calls are reported when they
    close (``ParsedCalls``)."""

    def __init__(self, markers: tuple[str, ...], argument_keys: tuple[str, ...], *,
                 bare: str | None = None, anywhere: bool = True, keep: str = "",
                 then: str | None = None):
        self.markers = markers
        self.keep = keep  # the marker's end that is the calls' own start (``[``)
        self.argument_keys = argument_keys
        self.bare = bare
        self.anywhere = anywhere
        self.then = then
        self.scanner: CallScanner | None = None
        self.started = False  # the marker (or a bare start) was found
        self.never = False  # the output began without one: no calls will follow
        self.begun = False  # a non-blank character came before any call
        self.pending = ""
        self.parsed = ParsedCalls()

    def finish(self) -> list[CallEvent]:
        return []  # a JSON call left open is no call

    def feed(self, text: str) -> list[CallEvent]:
        if self.scanner is not None:
            return self.parsed.passed(self.scanner.feed(text))
        if self.never:
            return []
        self.pending += text
        if not self.started:
            self.started = self._start()
            if not self.started:
                return []
        body = self.pending.lstrip()
        if not body:
            return []
        self.pending = ""
        depth = 2 if body[0] == "[" and self.then != ";" else 1
        self.scanner = CallScanner(depth, self.argument_keys, self.then)
        return self.parsed.passed(self.scanner.feed(body))

    def _start(self) -> bool:
        """Whether the calls begin in ``pending`` (which then keeps what follows)."""
        text = self.pending if self.anywhere else self.pending.lstrip()
        found = [(at, len(m)) for m in self.markers for at in (text.find(m),)
                 if at == 0 or (at > 0 and self.anywhere)]
        if found:
            at, n = min(found)
            self.pending = self.keep + text[at + n:]
            return True
        if self.bare is not None and not self.begun:
            head = self.pending.lstrip()
            if head.startswith(self.bare):
                return True
            self.begun = bool(head)  # the output began otherwise: no bare calls
        if self.anywhere:  # keep only what may begin a marker
            keep = max(held_suffix(self.pending, m) for m in self.markers)
            self.pending = self.pending[len(self.pending) - keep:]
        elif text and not any(m.startswith(text[:len(m)]) for m in self.markers):
            self.pending, self.never = "", True  # the output began otherwise
        return False


class CallStream(Protocol):
    """What reads a format's calls as they are written: ``feed`` the output's next
    characters; ``finish`` when it ended (the events of a call the format lets the output
    leave open)."""

    def feed(self, text: str) -> list[CallEvent]: ...

    def finish(self) -> list[CallEvent]: ...


def streamed_arguments(scanner: CallStream, text: str) -> list[tuple[str, str | None]]:
    """Every call of the whole ``text``: its name, and its arguments as they would have
    streamed (None for a call that would have been sent whole)."""
    calls: dict[int, list] = {}
    for e in [*scanner.feed(text), *scanner.finish()]:
        if isinstance(e, CallStart):
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArguments):
            calls[e.index][1] += e.text
        elif not e.streamed:
            calls[e.index] = [e.name, None]
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]

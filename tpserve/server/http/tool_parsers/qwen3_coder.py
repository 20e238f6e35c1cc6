"""Qwen3-Coder format (vLLM's ``qwen3_coder``: Qwen3-Coder and the later Qwen models whose
template writes calls as XML): each call is

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

read as vLLM reads it. A VALUE ends at its ``</parameter>`` or, where the model left that
out, before the next ``<parameter=`` that starts a line, or at the call's end (a last
``</function>`` and blanks dropped): at ``</tool_call>`` or the output's end; one newline
is trimmed on each side. After ``</function>`` the rest of the call is ignored. A first
call written without its ``<tool_call>`` is a call too (vLLM's back-off when an output has
no ``<tool_call>``): a ``<function=`` before any ``<tool_call>`` opens it. Text before the
first call is content; text after a call, up to the next ``<tool_call>``, is ignored. A
call the output leaves open is still read (an unfinished tag at its end ignored); any
other text inside a call, before its ``</function>``, makes the whole output content.

VALUE is raw text, converted by the type the request's tool declares for KEY
(``parameters.properties``), its name read as vLLM normalizes it: ``string`` (``str``,
``text``, ``varchar``, ``char``, ``enum``) kept as written; ``integer`` (any name starting
``int``, ``uint``, ``long``, ``short`` or ``unsigned``) and ``number`` (``num...``,
``float...``) parsed; ``boolean`` (``bool``, ``binary``) from true / false; ``object``
(``dict...``) and ``array`` (``arr``, ``list...``) as JSON, else a Python literal (by
``ast.literal_eval``); ``null`` is null for any type but a string. An undeclared key, or a
value its type cannot read (or JSON cannot hold: a set, ``inf``), stays a string. Whole
and streamed outputs are read by one reader (``XmlCalls``), so a stream's calls are the
whole answer's (but where text inside a call breaks it after its start went out: the
stream cannot take that back); streamed, a call's arguments grow a parameter at a time."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import CallArguments, CallEnd, CallEvent, CallStart
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    MarkerToolParser,
    ParsedCall,
    held_suffix,
)

CALL, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_FUNCTION_UNFINISHED = re.compile(r"\s*<function=[^>\n]*")
_PARAMETER_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>")
_PARAMETER_UNFINISHED = re.compile(r"\s*<parameter=[^>\n]*")
_LAST_FUNCTION_END = re.compile(r"</function>\s*\Z")
_TAGS = (PARAMETER, FUNCTION_END, END)  # what may come between a call's parameters
_END_TAG = max(len(PARAMETER_END), len("\n" + PARAMETER), len(END))  # what ends a value

_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER = ("int", "uint", "long", "short", "unsigned")


def _properties(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The declared parameters of the request's function ``name`` ({} if none)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return ((function.get("parameters") or {}).get("properties")) or {}
    return {}


def _kind(schema: Any) -> str | None:
    """A parameter's declared type, its name normalized as vLLM reads it (None: none)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
    if not isinstance(kind, str):
        return None
    kind = kind.strip().lower()
    if kind in _STRING:
        return "string"
    if kind.startswith(_INTEGER):
        return "integer"
    if kind.startswith(("num", "float")):
        return "number"
    if kind in ("boolean", "bool", "binary"):
        return "boolean"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        return "container"
    return kind


def _convert(value: str, schema: Any) -> Any:
    kind = _kind(schema)
    if kind is None or kind == "string":
        return value
    text = value.strip()
    if text.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(text) if re.fullmatch(r"[+-]?\d+", text) else number
        if kind == "boolean":
            return {"true": True, "false": False}[text.lower()]
        if kind == "container":
            try:
                return json.loads(text)
            except ValueError:
                return ast.literal_eval(text)
    except (ValueError, KeyError, SyntaxError, RecursionError, TypeError, MemoryError):
        return value
    return value


def _member(key: str, raw: str, schema: Any) -> str:
    """One parameter as its arguments' JSON member; ``raw`` as written, one newline
    trimmed on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    try:
        value = json.dumps(_convert(raw, schema), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # what JSON cannot hold (a set, bytes, inf, nan)
        value = json.dumps(raw, ensure_ascii=False)
    return json.dumps(key, ensure_ascii=False) + ": " + value


def _value_end(value: str, start: int = 0) -> tuple[int, int] | None:
    """Where a value (the text after its ``<parameter=KEY>``) ends, and where the reading
    goes on: after its ``</parameter>``; at a ``<parameter=`` that starts a line (or the
    value); at ``</tool_call>``. None while none of them came (the earliest wins).
    ``start``: where to look from (before it, none of them was found)."""
    ends = []
    close = value.find(PARAMETER_END, start)
    if close >= 0:
        ends.append((close, close + len(PARAMETER_END)))
    if value.startswith(PARAMETER):
        ends.append((0, 0))
    elif (line := value.find("\n" + PARAMETER, start)) >= 0:
        ends.append((line + 1, line + 1))  # the newline is the value's, then trimmed
    end = value.find(END, start)
    if end >= 0:
        ends.append((end, end))
    return min(ends) if ends else None


class XmlCalls:
    """Qwen3-Coder calls read as they are written (``call_scanner.CallStream``); also what
    reads a whole output (``Qwen3CoderToolParser.extract``). A call's start (and its
    arguments' ``{``) goes out once what follows its ``<function=NAME>`` is a parameter,
    its end or the output's end; each parameter, once its value ended, is its arguments'
    next JSON member; ``</function>`` (or ``</tool_call>``, or the output's end) closes
    them. So the arguments stream as ``json.dumps`` writes a dict: ``{"a": 1, "b": "x"}``.
    Text the format does not allow inside a call ends the reading (``broken``: the whole
    output is content; a call already started is closed)."""

    def __init__(self, tools: Sequence[dict[str, Any]]):
        self.tools = tools
        self.pending = ""
        self.read = 0  # characters of the output before ``pending``
        self.first: int | None = None  # where the first call's opening tag begins
        self.stage = "outside"  # outside, function, parameters, value
        self.call: tuple[int, str, dict[str, Any]] | None = None  # index, name, properties
        self.started = False  # the open call's start went out
        self.key = ""  # the parameter whose value is being read
        self.looked = 0  # how much of the value was searched for its end
        self.members = 0  # of the open call's arguments
        self.calls = 0
        self.broken = False

    def feed(self, text: str) -> list[CallEvent]:
        self.pending += text
        events: list[CallEvent] = []
        while not self.broken and self._step(events):
            pass
        return events

    def finish(self) -> list[CallEvent]:
        """The output ended: an open call closes (a value open at the end ends there)."""
        events: list[CallEvent] = []
        if self.call is None or (self.broken and not self.started):
            return events
        if self.stage == "value" and not self.broken:
            self._parameter(_LAST_FUNCTION_END.sub("", self.pending), events)
        self._close(events)
        return events

    def _cut(self, n: int) -> None:
        self.pending, self.read = self.pending[n:], self.read + n

    def _step(self, events: list[CallEvent]) -> bool:
        """Reads one element off ``pending``; False when it needs more text."""
        if self.stage == "outside":
            return self._opening()
        if self.stage == "function":
            found = _FUNCTION_OPEN.match(self.pending)
            if found is None:
                self.broken = _FUNCTION_UNFINISHED.fullmatch(self.pending) is None and not (
                    FUNCTION.startswith(self.pending.lstrip()))
                return False
            name = found[1].strip()
            self.call = (self.calls, name, _properties(self.tools, name))
            self.calls += 1
            self.started, self.members, self.stage = False, 0, "parameters"
            self._cut(found.end())
            return True
        if self.stage == "value":
            found = _value_end(self.pending, self.looked)
            if found is None:  # look again only where an end tag may have been cut
                self.looked = max(0, len(self.pending) - _END_TAG)
                return False
            value, goes_on = found
            raw = self.pending[:value]
            if self.pending.startswith(END, value):
                raw = _LAST_FUNCTION_END.sub("", raw)
            self._parameter(raw, events)
            self._cut(goes_on)
            self.stage = "parameters"
            return True
        return self._between(events)

    def _opening(self) -> bool:
        """Outside a call: the next ``<tool_call>`` (or, before any call, ``<function=``)
        opens one; the text before it is not read."""
        tags = (CALL, FUNCTION) if self.calls == 0 else (CALL,)
        found = [(at, tag) for tag in tags if (at := self.pending.find(tag)) >= 0]
        if not found:
            self._cut(len(self.pending) - max(held_suffix(self.pending, t) for t in tags))
            return False
        at, tag = min(found)
        if self.first is None:
            self.first = self.read + at
        self._cut(at + (len(CALL) if tag == CALL else 0))
        self.stage = "function"
        return True

    def _between(self, events: list[CallEvent]) -> bool:
        """Between a call's parameters: the next one, the call's end, or more text."""
        body = self.pending.lstrip()
        if body.startswith(PARAMETER):
            found = _PARAMETER_OPEN.match(self.pending)
            if found is None:
                self.broken = _PARAMETER_UNFINISHED.fullmatch(self.pending) is None
                if not self.broken:
                    self._start(events)  # a parameter follows the name: it is a call
                return False
            self._start(events)
            self.key, self.stage, self.looked = found[1].strip(), "value", 0
            self._cut(found.end())
            return True
        for tag in (FUNCTION_END, END):
            if body.startswith(tag):
                self._close(events)
                self._cut(len(self.pending) - len(body) + len(tag))
                self.stage = "outside"
                return True
        self.broken = not any(tag.startswith(body) for tag in _TAGS)
        return False

    def _start(self, events: list[CallEvent]) -> None:
        assert self.call is not None
        if not self.started:
            self.started = True
            events += [CallStart(self.call[0], self.call[1]), CallArguments(self.call[0], "{")]

    def _parameter(self, raw: str, events: list[CallEvent]) -> None:
        assert self.call is not None
        member = _member(self.key, raw, self.call[2].get(self.key))
        events.append(CallArguments(self.call[0], (", " if self.members else "") + member))
        self.members += 1

    def _close(self, events: list[CallEvent]) -> None:
        assert self.call is not None
        self._start(events)
        events += [CallArguments(self.call[0], "}"),
                   CallEnd(self.call[0], True, self.call[1], None)]
        self.call = None


class Qwen3CoderToolParser(MarkerToolParser):
    marker = CALL

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> XmlCalls:
        return XmlCalls(tools)

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        reader = XmlCalls(tools)
        calls: dict[int, list[str]] = {}
        for e in reader.feed(text) + reader.finish():
            if isinstance(e, CallStart):
                calls[e.index] = [e.name, ""]
            elif isinstance(e, CallArguments):
                calls[e.index][1] += e.text
        if reader.broken or not calls:
            return ExtractedToolCalls(text)
        assert reader.first is not None
        return ExtractedToolCalls(text[:reader.first] or None,
                                  [ParsedCall(*calls[i]) for i in sorted(calls)])

    def content_prefix_len(self, text: str) -> int:
        """Content ends at the first ``<tool_call>`` or ``<function=`` (a call without its
        tag); hold an end that may begin either."""
        found = [at for tag in (CALL, FUNCTION) if (at := text.find(tag)) >= 0]
        if found:
            return min(found)
        return len(text) - max(held_suffix(text, CALL), held_suffix(text, FUNCTION))

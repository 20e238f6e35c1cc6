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

VALUE is raw text (one newline trimmed on each side), converted by the type the request's
tool declares for KEY (``parameters.properties``): ``string`` kept as written; ``integer``
and ``number`` parsed; ``boolean`` from true / false; ``object`` and ``array`` as JSON (else
a Python literal, by ``ast.literal_eval``); ``null`` is null for any type but ``string``. An
undeclared key, or a value its type cannot read, stays a string. Text before the first
``<tool_call>`` is content; an unclosed last call (the output ended) is still parsed; any
other text inside a call makes the whole output content. Streamed, a call's arguments grow
a parameter at a time (``XmlCalls``)."""

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

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _properties(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The declared parameters of the request's function ``name`` ({} if none)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return ((function.get("parameters") or {}).get("properties")) or {}
    return {}


def _convert(value: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), None)
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
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except ValueError:
                return ast.literal_eval(text)
    except (ValueError, KeyError, SyntaxError, RecursionError, TypeError):
        return value
    return value


def _call(body: str, tools: Sequence[dict[str, Any]]) -> ParsedCall | None:
    found = _FUNCTION.fullmatch(body.strip())
    if found is None:
        return None
    name, rest = found[1].strip(), found[2]
    properties = _properties(tools, name)
    args, pos = {}, 0
    for m in _PARAMETER.finditer(rest):
        if rest[pos:m.start()].strip():
            return None  # text between parameters
        key = m[1].strip()
        args[key] = _convert(m[2], properties.get(key))
        pos = m.end()
    if rest[pos:].strip():
        return None
    try:
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))
    except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes)
        return None


_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER_OPEN = re.compile(r"\s*<parameter=")
_FUNCTION_CLOSE = re.compile(r"\s*(?:</function>\s*)?(?:</tool_call>|\Z)")


class XmlCalls:
    """Qwen3-Coder calls read as they are written (``call_scanner.CallStream``): a call
    starts at its ``<function=NAME>``; each parameter, once its ``</parameter>`` came, is
    its arguments' next JSON member (typed as ``extract`` types it); ``</function>`` (or
    the output's end) closes them. So the arguments stream as ``json.dumps`` writes the
    whole call's: ``{"a": 1, "b": "x"}``."""

    def __init__(self, tools: Sequence[dict[str, Any]]):
        self.tools = tools
        self.pending = ""
        self.inside = False  # after <tool_call>
        self.call: tuple[int, str, dict[str, Any]] | None = None  # index, name, properties
        self.members = 0  # of the open call's arguments
        self.calls = 0

    def feed(self, text: str) -> list[CallEvent]:
        self.pending += text
        events: list[CallEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[CallEvent]:
        """The output ended: an open call closes (``extract`` reads it so too)."""
        events: list[CallEvent] = []
        if self.call is not None:
            self._close(events)
        return events

    def _step(self, events: list[CallEvent]) -> bool:
        """Reads one element off ``pending``; False when it needs more text."""
        if not self.inside:
            at = self.pending.find("<tool_call>")
            if at < 0:
                self.pending = self.pending[len(self.pending)
                                            - held_suffix(self.pending, "<tool_call>"):]
                return False
            self.pending, self.inside = self.pending[at + len("<tool_call>"):], True
            return True
        if self.call is None:
            found = _FUNCTION_OPEN.match(self.pending)
            if found is None:
                return False
            name = found[1].strip()
            self.call = (self.calls, name, _properties(self.tools, name))
            self.calls += 1
            self.members = 0
            self.pending = self.pending[found.end():]
            events += [CallStart(self.call[0], name), CallArguments(self.call[0], "{")]
            return True
        if _PARAMETER_OPEN.match(self.pending):
            found = _PARAMETER.match(self.pending)
            if found is None:
                return False
            key = found[1].strip()
            value = _convert(found[2], self.call[2].get(key))
            member = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(
                value, ensure_ascii=False)
            events.append(CallArguments(self.call[0], (", " if self.members else "") + member))
            self.members += 1
            self.pending = self.pending[found.end():]
            return True
        closed = _FUNCTION_CLOSE.match(self.pending)
        if closed is None or (closed.end() == len(self.pending)
                              and "</tool_call>" not in self.pending[:closed.end()]):
            return False  # more may come (the output's end is finish's)
        self.pending = self.pending[closed.end():]
        self._close(events)
        return True

    def _close(self, events: list[CallEvent]) -> None:
        assert self.call is not None
        events += [CallArguments(self.call[0], "}"),
                   CallEnd(self.call[0], True, self.call[1], None)]
        self.call, self.inside = None, False


class Qwen3CoderToolParser(MarkerToolParser):
    marker = "<tool_call>"

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> XmlCalls:
        return XmlCalls(tools)

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        return self.calls_in(text, _CALL.findall(text), lambda body: _call(body, tools))

"""Pythonic format (Llama 3.2 and Llama 4; vLLM's ``pythonic`` parser): the whole output is
a Python list of calls with keyword arguments, ``[get_weather(city="Paris"), ping()]``,
optionally between Llama 4's ``<|python_start|>`` and ``<|python_end|>``. The text is
parsed by ``ast`` (never evaluated): each argument must be a literal (string, number,
True / False / None, or a list, tuple, dict or set of literals), turned into JSON (a tuple
or set as a list). Output that is not such a list is content."""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import CallArguments, CallEnd, CallEvent, CallStart
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    held_suffix,
)

START, END = "<|python_start|>", "<|python_end|>"


def _name(func: ast.expr) -> str | None:
    """A call's function: a name or a dotted name (``module.tool``)."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = _name(func.value)
        return None if base is None else f"{base}.{func.attr}"
    return None


def _json(value):
    """A literal as JSON's types: tuples and sets as lists; None when a dict key is not a
    string, number or boolean (JSON keys are strings)."""
    if isinstance(value, tuple | list | set | frozenset):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str | int | float | bool) for k in value):
            raise ValueError("a dict key that JSON cannot hold")
        return {str(k) if not isinstance(k, str) else k: _json(v) for k, v in value.items()}
    if isinstance(value, complex | bytes):
        raise ValueError("not a JSON value")
    return value


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None  # positional arguments have no names to send
    name = _name(node.func)
    if name is None or any(k.arg is None for k in node.keywords):  # **kwargs
        return None
    try:
        args = {k.arg: _json(ast.literal_eval(k.value)) for k in node.keywords}
        return ParsedCall(name, json.dumps(args, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


class PythonicCalls:
    """Pythonic calls read as they are written (``call_scanner.CallStream``), a call at a
    time: an element of the list is complete at the first ``,`` or ``]`` after it where
    its text parses as a call (a cut inside a string or a nested literal does not parse),
    and then goes out whole: its start, its arguments, its end. The list must start the
    output, as ``extract`` reads it; an element that is no call stops the reading."""

    def __init__(self) -> None:
        self.text = ""
        self.start: int | None = None  # where the current element begins
        self.tried = 0  # where the search for its end goes on
        self.calls = 0
        self.never = False

    def feed(self, text: str) -> list[CallEvent]:
        self.text += text
        events: list[CallEvent] = []
        if self.never:
            return events
        if self.start is None and not self._begin():
            return events
        assert self.start is not None
        while True:
            cut = next((i for i in range(max(self.tried, self.start), len(self.text))
                        if self.text[i] in ",]"), None)
            if cut is None:
                self.tried = len(self.text)
                return events
            self.tried = cut + 1
            try:
                node = ast.parse(self.text[self.start:cut].strip(), mode="eval").body
            except (SyntaxError, ValueError, RecursionError):
                continue  # cut inside the element
            call = _call(node)
            if call is None:
                self.never = True
                return events
            events += [CallStart(self.calls, call.name), CallArguments(self.calls, call.arguments),
                       CallEnd(self.calls, True, call.name, None)]
            self.calls += 1
            if self.text[cut] == "]":
                self.never = True  # the list ended
                return events
            self.start = cut + 1

    def finish(self) -> list[CallEvent]:
        return []  # an element the output left unfinished is no call

    def _begin(self) -> bool:
        """Whether the list started (``start``: after its ``[``); sets ``never`` when the
        output began otherwise."""
        body = self.text.lstrip()
        if body.startswith(START):
            body = body[len(START):].lstrip()
        elif not body or START.startswith(body[:len(START)]):
            return False
        if not body:
            return False
        if not body.startswith("["):
            self.never = True
            return False
        self.start = len(self.text) - len(body) + 1
        return True


class PythonicToolParser(ToolParser):
    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> PythonicCalls:
        return PythonicCalls()

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START):]
            body = body[:-len(END)] if body.endswith(END) else body
        body = body.strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text)
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return ExtractedToolCalls(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ExtractedToolCalls(text)
        calls = [_call(node) for node in tree.elts]
        if any(c is None for c in calls):
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, calls)

    def content_prefix_len(self, text: str) -> int:
        """A call list can only start the output: hold it while it is blank, starts with
        ``[`` or is (the beginning of) ``<|python_start|>``."""
        body = text.lstrip()
        if not body or body.startswith("[") or body.startswith(START) or (
                held_suffix(body, START) == len(body)):
            return 0
        return len(text)

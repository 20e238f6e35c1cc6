"""Llama 3 JSON format: the output is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``; more calls may follow, each after
blanks and at most one ``;``. The calls end where anything else comes: the rest of the
output is ignored (vLLM's ``llama3_json`` returns the calls and drops the text around
them). Output that does not start with a call is content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import AfterMarker
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    as_call,
    held_suffix,
)

PYTHON_TAG = "<|python_tag|>"
_SPACE = " \t\r\n"  # JSON's blanks, as ``CallScanner`` skips them between calls


class Llama3JsonToolParser(ToolParser):
    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> AfterMarker:
        return AfterMarker((PYTHON_TAG,), ("parameters", "arguments"), bare="{",
                           anywhere=False, then=";")

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text)
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while True:
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(text)
            call = as_call(obj, "parameters", "arguments")
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
            rest = body[end:].lstrip(_SPACE)
            if rest.startswith(";"):
                rest = rest[1:].lstrip(_SPACE)
            if not rest.startswith("{"):  # the calls ended
                return ExtractedToolCalls(None, calls)
            pos = len(body) - len(rest)

    def content_prefix_len(self, text: str) -> int:
        """A call can only start the output: hold it while it is blank, starts with ``{``
        or is (the beginning of) the python tag."""
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(PYTHON_TAG) or (
                held_suffix(body, PYTHON_TAG) == len(body)):
            return 0
        return len(text)

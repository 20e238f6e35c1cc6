"""Llama 3 JSON format: the whole output is ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``; several calls are separated by
``;``. Output that does not start with a call is content (as vLLM's ``llama3_json``)."""

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


class Llama3JsonToolParser(ToolParser):
    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> AfterMarker:
        return AfterMarker((PYTHON_TAG,), ("parameters", "arguments"), bare="{",
                           anywhere=False)

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
            rest = body[end:].lstrip()
            if not rest:
                return ExtractedToolCalls(None, calls)
            if not rest.startswith(";"):
                return ExtractedToolCalls(text)
            pos = len(body) - len(rest[1:].lstrip())

    def content_prefix_len(self, text: str) -> int:
        """A call can only start the output: hold it while it is blank, starts with ``{``
        or is (the beginning of) the python tag."""
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(PYTHON_TAG) or (
                held_suffix(body, PYTHON_TAG) == len(body)):
            return 0
        return len(text)

"""Granite format (IBM Granite 3.x; vLLM's ``granite`` parser): the output is a JSON list
of ``{"name": ..., "arguments": {...}}`` after the marker ``<|tool_call|>`` (Granite 3.0)
or ``<tool_call>`` (3.1 and later), or the bare list; text before the marker is content.
Output without a marker that does not start with a list is content. ``<|tool_call|>`` is a
special token, so requests parsed with this format keep special tokens in the output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import AfterMarker
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    all_calls,
    as_call,
    held_suffix,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    needs_special_tokens = True

    def _start(self, text: str) -> tuple[int, int]:
        """``(where the content ends, where the list starts)``: at the first marker, else
        a list that starts the output (after blanks), else ``(-1, -1)``."""
        found = [(text.find(m), len(m)) for m in MARKERS if m in text]
        if found:
            at, n = min(found)
            return at, at + n
        body = text.lstrip()
        return (0, len(text) - len(body)) if body.startswith("[") else (-1, -1)

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> AfterMarker:
        return AfterMarker(MARKERS, ("arguments",), bare="[")

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        at, start = self._start(text)
        if at < 0:
            return ExtractedToolCalls(text)
        try:
            decoded = json.loads(text[start:])
        except ValueError:
            return ExtractedToolCalls(text)
        if not isinstance(decoded, list):
            return ExtractedToolCalls(text)
        return all_calls(text, at, decoded, lambda item: as_call(item, "arguments"))

    def content_prefix_len(self, text: str) -> int:
        """Before a marker, content; a list can also start the output: hold it while it is
        blank or starts with ``[``; hold an end that may begin a marker."""
        at, _ = self._start(text)
        if at >= 0:
            return at
        if not text.strip():
            return 0
        return len(text) - max(held_suffix(text, m) for m in MARKERS)

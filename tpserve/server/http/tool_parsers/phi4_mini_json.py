"""Phi-4-mini format (vLLM's ``phi4_mini_json``): ``functools[{"name": ..., "arguments":
{...}}, ...]``, a JSON list after the word ``functools``; text before it is content, text
after it is ignored (as vLLM's parser reads only the list). Output without it, or whose
list does not parse to calls, is content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import AfterMarker
from tpserve.server.http.tool_parsers.base import ExtractedToolCalls, MarkerToolParser, as_call


class Phi4MiniJsonToolParser(MarkerToolParser):
    marker = "functools["

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> AfterMarker:
        return AfterMarker((self.marker,), ("arguments", "parameters"), keep="[", then="")

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        at = text.find(self.marker)
        if at < 0:
            return ExtractedToolCalls(text)
        start = at + len(self.marker) - 1  # the list's "["
        try:
            decoded, _ = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            return ExtractedToolCalls(text)
        if not isinstance(decoded, list):
            return ExtractedToolCalls(text)
        return self.calls_in(text, decoded, lambda item: as_call(item, "arguments",
                                                                 "parameters"))

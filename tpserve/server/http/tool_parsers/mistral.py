"""Mistral format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (a single object
is accepted too); text before the marker is content (as vLLM's ``mistral`` parser).
``[TOOL_CALLS]`` is a special token, so requests parsed with this format keep special
tokens in the output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import AfterMarker
from tpserve.server.http.tool_parsers.base import ExtractedToolCalls, MarkerToolParser, as_call


class MistralToolParser(MarkerToolParser):
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> AfterMarker:
        return AfterMarker(("[TOOL_CALLS]",), ("arguments",))

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        at = text.find(self.marker)
        if at < 0:
            return ExtractedToolCalls(text)
        try:
            decoded = json.loads(text[at + len(self.marker):])
        except ValueError:
            return ExtractedToolCalls(text)
        items = decoded if isinstance(decoded, list) else [decoded]
        return self.calls_in(text, items, lambda item: as_call(item, "arguments"))

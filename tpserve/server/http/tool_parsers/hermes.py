"""Hermes / Qwen2 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of times; text before the first call is content (as vLLM's ``hermes`` parser). An
unclosed last call (the output ended) is still parsed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.tool_parsers.base import ExtractedToolCalls, MarkerToolParser, as_call

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesToolParser(MarkerToolParser):
    marker = "<tool_call>"

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        at = text.find(self.marker)
        if at < 0:
            return ExtractedToolCalls(text)
        calls = []
        for closed, unclosed in _CALL.findall(text):
            try:
                call = as_call(json.loads(closed or unclosed), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
        return ExtractedToolCalls(text[:at] or None, calls)

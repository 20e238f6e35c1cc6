"""Hermes / Qwen2 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of times; text before the first call is content (as vLLM's ``hermes`` parser). An
unclosed last call (the output ended) is still parsed. Calls stream as they are written
(``call_stream``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.call_scanner import MarkedCalls
from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    MarkerToolParser,
    ParsedCall,
    as_call,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


class HermesToolParser(MarkerToolParser):
    marker = "<tool_call>"

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        return self.calls_in(text, [closed or unclosed for closed, unclosed
                                    in _CALL.findall(text)], _parse)

    def call_stream(self, tools: Sequence[dict[str, Any]] = ()) -> MarkedCalls:
        return MarkedCalls("<tool_call>", "</tool_call>", ("arguments",))


def _parse(body: str) -> ParsedCall | None:
    try:
        return as_call(json.loads(body), "arguments")
    except ValueError:
        return None

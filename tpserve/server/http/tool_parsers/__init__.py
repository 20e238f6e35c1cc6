"""Tool-call parsers for ``tool_choice: auto`` (vLLM's ``--tool-call-parser NAME``): each
turns a model's whole output text into plain content and OpenAI tool calls, one module per
output format. Malformed calls leave the whole text as plain content, with no calls."""

from __future__ import annotations

from tpserve.server.http.tool_parsers.base import ExtractedToolCalls, ParsedCall, ToolParser
from tpserve.server.http.tool_parsers.granite import GraniteToolParser
from tpserve.server.http.tool_parsers.hermes import HermesToolParser
from tpserve.server.http.tool_parsers.llama3_json import Llama3JsonToolParser
from tpserve.server.http.tool_parsers.mistral import MistralToolParser
from tpserve.server.http.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from tpserve.server.http.tool_parsers.pythonic import PythonicToolParser
from tpserve.server.http.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedCall", "ToolParser"]

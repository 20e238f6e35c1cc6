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
other text inside a call makes the whole output content."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from tpserve.server.http.tool_parsers.base import (
    ExtractedToolCalls,
    MarkerToolParser,
    ParsedCall,
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


class Qwen3CoderToolParser(MarkerToolParser):
    marker = "<tool_call>"

    def extract(self, text: str, tools: Sequence[dict[str, Any]] = ()) -> ExtractedToolCalls:
        return self.calls_in(text, _CALL.findall(text), lambda body: _call(body, tools))

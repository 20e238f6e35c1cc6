"""OpenAI's ``reasoning_effort`` as vLLM hands it to the chat template.

vLLM passes the value to the template as ``reasoning_effort`` and, unless the request's
``chat_template_kwargs`` set it, ``enable_thinking`` (false for ``"none"``, else true), the
switch of Qwen3-style templates. Here the same, with one rule more: a template that reads
neither variable could not honour the field, so the request is refused with 400 instead
of the value being ignored. "Reads" means the template's source names the variable (a
template that tests ``enable_thinking is defined`` reads it too).
"""

from __future__ import annotations

import re
from typing import Any

from tpserve.server.http.http_errors import APIError

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_READS = {name: re.compile(rf"\b{name}\b") for name in ("reasoning_effort", "enable_thinking")}


def template_source(template: str | None, tokenizer_template: Any, tools: bool) -> str:
    """The text of the template a render uses: ``template`` (a request's or the server's:
    a template's text, or the name of one of the tokenizer's), else the tokenizer's (of
    several: ``tool_use`` when the request has tools and the tokenizer that template, else
    ``default``, as transformers picks)."""
    named = tokenizer_template if isinstance(tokenizer_template, dict) else {}
    if template is not None:
        return named.get(template, template)
    if named:
        return named["tool_use"] if tools and "tool_use" in named else named.get("default", "")
    return tokenizer_template or ""


def effort_kwargs(effort: str, source: str, asked: dict[str, Any]) -> dict[str, Any]:
    """The template variables ``effort`` sets for a template with text ``source``
    (``enable_thinking`` unless the request's own ``asked`` kwargs set it; they go over
    these, these over the server's defaults); 400 for a value outside ``EFFORTS`` or a
    template that reads neither variable."""
    if effort not in EFFORTS:
        raise APIError.bad_request(f"reasoning_effort must be one of {', '.join(EFFORTS)}, "
                                   f"got {effort!r}", "reasoning_effort")
    if not any(pattern.search(source) for pattern in _READS.values()):
        raise APIError.bad_request(
            "reasoning_effort is not supported with this model: its chat template reads "
            "neither reasoning_effort nor enable_thinking", "reasoning_effort")
    out: dict[str, Any] = {"reasoning_effort": effort}
    if "enable_thinking" not in asked:
        out["enable_thinking"] = effort != "none"
    return out

"""Tool calling on chat completions: ``tools`` and ``tool_choice`` to a plan, and a
choice's output text to ``message.tool_calls``.

``tool_choice`` (default ``auto`` when ``tools`` are given, as in OpenAI and vLLM):
- ``none``: the tools reach the chat template; the output is plain content.
- ``auto``: needs ``--enable-auto-tool-choice --tool-call-parser NAME`` (400 otherwise, as
  vLLM); the output is free and the parser (``http/tool_parsers/``) finds calls in it.
- ``required``: the output is constrained (the structured-output grammar) to a JSON array
  of one or more calls ``{"name": NAME, "parameters": ARGS}``, each with ``ARGS`` following
  that tool's schema (exactly one call when ``parallel_tool_calls`` is false); finish
  reason ``tool_calls``.
- a named function: constrained to one such object for that function; finish reason
  ``stop`` (what OpenAI and vLLM answer for a forced function).
If the constrained output does not parse (``max_tokens`` cut it short) it is returned as
plain content with the engine's finish reason; streamed, the calls' starts and arguments
written so far have gone out already (``call_scanner.py``), and nothing follows them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.spec import GrammarError, check_structured_output
from tpserve.server.http.call_scanner import CallScanner, CallStream, streamed_arguments
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, ChatTool, FunctionCall, ToolCall
from tpserve.server.http.tool_parsers import ParsedCall, ToolParser
from tpserve.server.http.tool_parsers.base import as_call

ToolMode = Literal["none", "auto", "required", "named"]
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``."""
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": tool.function.parameters or NO_ARGUMENTS},
            "required": ["name", "parameters"]}


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """An array of one or more calls of any of ``tools`` (exactly one unless ``parallel``)."""
    items = [call_schema(t) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_calls(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the template's ``tools``, the constraint (required,
    named) or the parser (auto) of the output."""

    mode: ToolMode
    template_tools: list[dict[str, Any]]
    structured: StructuredOutput | None = None
    parser: ToolParser | None = None

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"

    def extract(self, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of one choice's whole output."""
        if self.mode == "auto":
            assert self.parser is not None
            found = self.parser.extract(text, self.template_tools)
            if found.tools_called:
                return (found.content, tool_calls(self._as_written(found.calls, text)),
                        "tool_calls")
            return text, [], finish_reason
        calls = self._as_written(self._constrained_calls(text), text)
        if not calls:
            return text, [], finish_reason
        if self.mode == "required" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return None, tool_calls(calls), finish_reason

    def call_stream(self) -> CallStream | None:
        """What reads the output's calls as they are written (``call_scanner.py``):
        constrained output's one call object (named) or array of them (required), the
        ``auto`` parser's format where it streams; None where calls come whole."""
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.call_stream(self.template_tools)
        if self.mode not in ("required", "named"):
            return None
        return CallScanner(2 if self.mode == "required" else 1, ("parameters",))

    def _constrained_calls(self, text: str) -> list[ParsedCall]:
        try:
            decoded = json.loads(text)
        except ValueError:
            return []
        items = decoded if self.mode == "required" else [decoded]
        if not isinstance(items, list):
            return []
        parsed = [as_call(item, "parameters") for item in items]
        calls = [c for c in parsed if c is not None]
        return calls if len(calls) == len(parsed) else []

    def _as_written(self, calls: list[ParsedCall], text: str) -> list[ParsedCall]:
        """``calls`` (parsed from the whole ``text``, their arguments re-encoded) with the
        arguments as written wherever they would have streamed (``call_stream``), so that
        a stream's argument deltas add up to the whole answer's."""
        stream = self.call_stream()
        if stream is None or not calls:
            return calls
        written = streamed_arguments(stream, text)
        if [name for name, _ in written] != [c.name for c in calls]:
            return calls
        return [ParsedCall(c.name, args) if args is not None else c
                for c, (_, args) in zip(calls, written, strict=True)]

    def content_prefix_len(self, text: str) -> int:
        """How much of a partial output streaming may send as content now: for ``auto``,
        what the parser knows cannot be a call; constrained output is always a call, so
        it is held (buffered) until the choice finishes, then sent as one delta."""
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.content_prefix_len(text)
        return 0


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as the chat template is shown them (None without tools)."""
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


def plan_tools(body: ChatCompletionRequest, auto_parser: ToolParser | None
               ) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400s as vLLM answers them.
    ``auto_parser`` is the server's ``--tool-call-parser`` when
    ``--enable-auto-tool-choice`` is set, else None."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError.bad_request("When using `tool_choice`, `tools` must be set.",
                                       "tool_choice")
        return None
    shown = template_tools(body) or []
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", shown)
    if choice == "auto":
        if auto_parser is None:
            raise APIError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set", "tool_choice")
        return ToolPlan("auto", shown, parser=auto_parser)
    if choice == "required":
        mode: ToolMode = "required"
        schema = required_schema(body.tools, body.parallel_tool_calls is not False)
    else:
        name = choice.function.name
        tool = next((t for t in body.tools if t.function.name == name), None)
        if tool is None:
            raise APIError.bad_request(f"Tool '{name}' has not been passed in `tools`.",
                                       "tool_choice")
        mode, schema = "named", call_schema(tool)
    spec = StructuredOutput("json", json.dumps(schema))
    try:
        check_structured_output(spec)
    except GrammarError as exc:
        raise APIError.bad_request(f"invalid JSON schema in tools: {exc}", "tools") from exc
    return ToolPlan(mode, shown, structured=spec)

"""Tool calling on chat completions: ``tools`` and ``tool_choice`` to a plan, and a
choice's output text to ``message.tool_calls``.

``tool_choice`` (default ``auto`` when ``tools`` are given, as in OpenAI and vLLM):
- ``none``: the tools reach the chat template; the output is plain content.
- ``auto``: needs ``--enable-auto-tool-choice --tool-call-parser NAME`` (400 otherwise, as
  vLLM); the output is free and the parser (``http/tool_parsers/``) finds calls in it;
  with ``parallel_tool_calls`` false only the first call is returned, whole and streamed
  (vLLM's ``maybe_filter_parallel_tool_calls``).
- ``required``: the output is constrained (the structured-output grammar) to a JSON array
  of one or more calls ``{"name": NAME, "parameters": ARGS}``, each with ``ARGS`` following
  that tool's schema (exactly one call when ``parallel_tool_calls`` is false); finish
  reason ``tool_calls``.
- a named function: constrained to one such object for that function; finish reason
  ``stop`` (what OpenAI and vLLM answer for a forced function).
A tool's parameters may use root definitions (``$defs`` or ``definitions``, referred to as
``#/$defs/NAME``, as pydantic writes them): the call schema carries every tool's at its own
root, where those pointers resolve (as vLLM hoists them); two tools that define one name
differently are refused with 400 (vLLM refuses them too).
If the constrained output does not parse (``max_tokens`` cut it short) it is returned as
plain content with the engine's finish reason; streamed, the calls' starts and arguments
written so far have gone out already (``call_scanner.py``), and nothing follows them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.engine.structured.spec import GrammarError, check_structured_output
from tpserve.server.http.call_scanner import CallScanner, CallStream, streamed_arguments
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatCompletionRequest, ChatTool, FunctionCall, ToolCall
from tpserve.server.http.tool_parsers import ParsedCall, ToolParser
from tpserve.server.http.tool_parsers.base import as_call, new_call_id

ToolMode = Literal["none", "auto", "required", "named"]
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
# where a JSON schema keeps the subschemas its root pointers (``#/$defs/NAME``) name
DEFINITIONS = ("$defs", "definitions")


def call_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``, its parameters' root definitions left out
    (``with_definitions`` puts them at the root of the schema that holds the call)."""
    parameters = tool.function.parameters or NO_ARGUMENTS
    return {"type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": {k: v for k, v in parameters.items() if not (
                               k in DEFINITIONS and isinstance(v, dict))}},
            "required": ["name", "parameters"]}


def with_definitions(schema: dict[str, Any], tools: list[ChatTool]) -> dict[str, Any]:
    """``schema`` (calls of ``tools``, ``call_schema``) with every tool's root definitions
    at its root, where the tools' root pointers (``#/$defs/NAME``) resolve. A name two
    tools define differently is a 400: a pointer could resolve to one tool's only."""
    merged: dict[str, dict[str, Any]] = {}
    for tool in tools:
        for key in DEFINITIONS:
            defs = (tool.function.parameters or {}).get(key)
            if not isinstance(defs, dict):
                continue
            into = merged.setdefault(key, {})
            for name, sub in defs.items():
                if into.setdefault(name, sub) != sub:
                    raise APIError.bad_request(
                        f"Tool definition '{name}' ({key}) has multiple schemas, which is "
                        f"not supported: give each its own name", "tools")
    return {**schema, **merged}


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """An array of one or more calls of any of ``tools`` (exactly one unless ``parallel``)."""
    items = [call_schema(t) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return with_definitions(schema, tools)


def tool_calls(calls: list[ParsedCall], call_id: Callable[[], str] = new_call_id
               ) -> list[ToolCall]:
    """``calls`` as OpenAI tool calls, each with a new ``call_id()``."""
    return [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools change: the template's ``tools``, the constraint (required,
    named) or the parser (auto) of the output. ``parallel`` false (the request's
    ``parallel_tool_calls``): only call 0 is returned, whole and streamed (``keeps``);
    ``required``'s grammar allows just one then, and ``named`` writes one anyway."""

    mode: ToolMode
    template_tools: list[dict[str, Any]]
    structured: StructuredOutput | None = None
    parser: ToolParser | None = None
    parallel: bool = True
    # the server's --tool-call-parser, for a constrained call's id (its form: Mistral's)
    id_parser: ToolParser | None = None

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"

    def keeps(self, index: int) -> bool:
        """Whether call ``index`` of an output is returned (all but 0 dropped unless
        ``parallel``)."""
        return self.parallel or index == 0

    def extract(self, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of one choice's whole output; the calls
        are those ``keeps`` keeps."""
        if self.mode == "auto":
            assert self.parser is not None
            found = self.parser.extract(text, self.template_tools)
            if found.tools_called:
                return (found.content, self._kept(self._as_written(found.calls, text)),
                        "tool_calls")
            return text, [], finish_reason
        calls = self._as_written(self._constrained_calls(text), text)
        if not calls:
            return text, [], finish_reason
        if self.mode == "required" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return None, self._kept(calls), finish_reason

    def _kept(self, calls: list[ParsedCall]) -> list[ToolCall]:
        return tool_calls([c for i, c in enumerate(calls) if self.keeps(i)], self.call_id)

    def call_id(self) -> str:
        """A new id for one of the output's calls, whole or streamed: the server's
        ``--tool-call-parser``'s (Mistral's templates take only 9 alphanumerics, so the
        calls can come back in the next turn), for a constrained call too (vLLM gives a
        forced call the Mistral form only on its Mistral-tokenizer path, so on the Hugging
        Face path its next turn fails there), else ``new_call_id``'s."""
        parser = self.parser if self.mode == "auto" else self.id_parser
        return new_call_id() if parser is None else parser.call_id()

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
    """The request's tools as the chat template is shown them (None without tools), as
    vLLM dumps them: ``name``, ``description`` and ``parameters`` always (None where the
    request leaves them out: a Hermes-style template reads ``tool.parameters`` of a tool
    without arguments, and JSON-dumping templates write the nulls), ``strict`` only when
    set."""
    if not body.tools:
        return None
    shown = [t.model_dump() for t in body.tools]
    for tool in shown:
        if tool["function"].get("strict") is None:
            tool["function"].pop("strict", None)
    return shown


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
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", shown)
    if choice == "auto":
        if auto_parser is None:
            raise APIError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set", "tool_choice")
        return ToolPlan("auto", shown, parser=auto_parser, parallel=parallel)
    if choice == "required":
        mode: ToolMode = "required"
        schema = required_schema(body.tools, parallel)
    else:
        name = choice.function.name
        tool = next((t for t in body.tools if t.function.name == name), None)
        if tool is None:
            raise APIError.bad_request(f"Tool '{name}' has not been passed in `tools`.",
                                       "tool_choice")
        mode, schema = "named", with_definitions(call_schema(tool), [tool])
    spec = StructuredOutput("json", json.dumps(schema))
    try:
        check_structured_output(spec)
    except GrammarError as exc:
        raise APIError.bad_request(f"invalid JSON schema in tools: {exc}", "tools") from exc
    return ToolPlan(mode, shown, structured=spec, parallel=parallel, id_parser=auto_parser)

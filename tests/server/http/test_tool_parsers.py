"""The tool-call parsers (``--tool-call-parser``) and the constrained-call extraction of
``tool_choice`` required / named, as pure functions."""

from __future__ import annotations

import json

import pytest

from tpserve.server.http.protocol import ChatTool
from tpserve.server.http.tool_parsers import TOOL_PARSERS, ExtractedToolCalls, ParsedCall
from tpserve.server.http.tools import ToolPlan, call_schema, required_schema

ARGS = '{"city": "Paris", "unit": "celsius"}'


def parse(name: str, text: str) -> ExtractedToolCalls:
    return TOOL_PARSERS[name]().extract(text)


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '</tool_call>', None, [ParsedCall("get_weather", ARGS)]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>', "Let me check.\n",
     [ParsedCall("a", "{}"), ParsedCall("b", '{"x": [1, 2]}')]),
    ('<tool_call>{"name": "a", "arguments": {"k": "é"}}', None,  # unclosed at the end
     [ParsedCall("a", '{"k": "é"}')]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', None,
     [ParsedCall("a", '{"k": 1}')]),
])
def test_hermes(text, content, calls):
    assert parse("hermes", text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("text", [
    "The weather is nice.",
    '<tool_call>{"name": "a", "arguments": {</tool_call>',          # malformed JSON
    '<tool_call>{"arguments": {}}</tool_call>',                      # no name
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',        # arguments not an object
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
])
def test_hermes_plain_content(text):
    assert parse("hermes", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     [ParsedCall("get_weather", ARGS)]),
    ('  <|python_tag|>{"name": "a", "arguments": {"x": 1}}\n', [ParsedCall("a", '{"x": 1}')]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": null}}',
     [ParsedCall("a", "{}"), ParsedCall("b", '{"y": null}')]),
    ('{"name": "a"}', [ParsedCall("a", "{}")]),
])
def test_llama3_json(text, calls):
    assert parse("llama3_json", text) == ExtractedToolCalls(None, calls)


@pytest.mark.parametrize("text", [
    "Sure, it is sunny.",
    'I would call {"name": "a", "parameters": {}}',    # a call must start the output
    '{"name": "a", "parameters": {"x": 1}',            # malformed JSON
    '{"name": "a", "parameters": {}} and more',        # trailing text
    '{"city": "Paris"}',                               # no name
])
def test_llama3_json_plain_content(text):
    assert parse("llama3_json", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}]', None, [ParsedCall("get_weather", ARGS)]),
    ('Checking. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
     '{"z": true}}]', "Checking. ", [ParsedCall("a", "{}"), ParsedCall("b", '{"z": true}')]),
    ('[TOOL_CALLS]{"name": "a", "arguments": {"q": "x"}}', None, [ParsedCall("a", '{"q": "x"}')]),
])
def test_mistral(text, content, calls):
    assert parse("mistral", text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("text", [
    "No tools needed.",
    '[TOOL_CALLS][{"name": "a", "arguments": {}',      # malformed JSON
    '[TOOL_CALLS][]',                                   # no call
    '[TOOL_CALLS][{"name": 3, "arguments": {}}]',       # name not a string
])
def test_mistral_plain_content(text):
    assert parse("mistral", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("name, text, expected", [
    ("hermes", "Hello <tool", len("Hello ")),
    ("hermes", "Hello <tool_call>{", len("Hello ")),
    ("hermes", "Hello <b>", len("Hello <b>")),
    ("mistral", "Hi [TOOL", len("Hi ")),
    ("mistral", "Hi [x]", len("Hi [x]")),
    ("llama3_json", "  ", 0),
    ("llama3_json", ' {"name"', 0),
    ("llama3_json", "<|python", 0),
    ("llama3_json", "Hello {", len("Hello {")),
])
def test_content_prefix_len(name, text, expected):
    assert TOOL_PARSERS[name]().content_prefix_len(text) == expected


TOOLS = [ChatTool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}),
    ChatTool.model_validate({"type": "function", "function": {"name": "ping"}})]


def test_constrained_schemas():
    assert call_schema(TOOLS[1]) == {
        "type": "object", "properties": {"name": {"type": "string", "enum": ["ping"]},
                                         "parameters": {"type": "object", "properties": {}}},
        "required": ["name", "parameters"]}
    assert required_schema(TOOLS, parallel=True) == {
        "type": "array", "minItems": 1, "items": {"anyOf": [call_schema(t) for t in TOOLS]}}
    assert required_schema(TOOLS[:1], parallel=False) == {
        "type": "array", "minItems": 1, "maxItems": 1, "items": call_schema(TOOLS[0])}


def test_constrained_extraction():
    required, named = ToolPlan("required", []), ToolPlan("named", [])
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                       {"name": "ping", "parameters": {}}])
    content, calls, finish = required.extract(text, "stop")
    assert (content, finish) == (None, "tool_calls")
    assert [(c.function.name, c.function.arguments, c.type) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}', "function"), ("ping", "{}", "function")]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert len({c.id for c in calls}) == 2
    content, calls, finish = named.extract('{"name": "ping", "parameters": {}}', "stop")
    assert (content, [c.function.name for c in calls], finish) == (None, ["ping"], "stop")
    # cut short by max_tokens: plain content, the engine's finish reason
    assert required.extract('[{"name": "ping", "para', "length") == (
        '[{"name": "ping", "para', [], "length")
    assert named.extract("[]", "stop") == ("[]", [], "stop")

"""The tool-call parsers (``--tool-call-parser``) and the constrained-call extraction of
``tool_choice`` required / named, as pure functions."""

from __future__ import annotations

import json

import pytest

from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import ChatTool
from tpserve.server.http.tool_parsers import TOOL_PARSERS, ExtractedToolCalls, ParsedCall
from tpserve.server.http.tools import ToolPlan, call_schema, required_schema, with_definitions

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


@pytest.mark.parametrize("text, calls", [
    ('[get_weather(city="Paris", unit="celsius")]', [ParsedCall("get_weather", ARGS)]),
    ("  [a(), tools.b(x=[1, (2, 3)], y={'k': None, 2: True}, z=-1.5e3)]\n",
     [ParsedCall("a", "{}"),
      ParsedCall("tools.b", '{"x": [1, [2, 3]], "y": {"k": null, "2": true}, "z": -1500.0}')]),
    ('<|python_start|>[ping(q="é")]<|python_end|>', [ParsedCall("ping", '{"q": "é"}')]),
])
def test_pythonic(text, calls):
    assert parse("pythonic", text) == ExtractedToolCalls(None, calls)


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    "[1, 2, 3]",                                       # not calls
    "[]",                                              # no call
    '[get_weather("Paris")]',                          # a positional argument
    "[f(**opts)]",                                     # keyword unpacking
    "[f(x=open('/etc/passwd'))]",                      # not a literal: never evaluated
    "[f(x=1j)]",                                       # no JSON value
    "[f(x=1)] and more",                               # trailing text
    "[f(x=1)",                                         # unclosed
    "[(lambda: 1)()]",                                 # not a named function
])
def test_pythonic_plain_content(text):
    assert parse("pythonic", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("text, content, calls", [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}]', None, [ParsedCall("get_weather", ARGS)]),
    ('Let me look. <tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
     '{"n": 2}}]', "Let me look. ", [ParsedCall("a", "{}"), ParsedCall("b", '{"n": 2}')]),
    (' [{"name": "a", "arguments": {"s": "x"}}]', None, [ParsedCall("a", '{"s": "x"}')]),
])
def test_granite(text, content, calls):
    assert parse("granite", text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("text", [
    "Nothing to call.",
    '<|tool_call|>[{"name": "a", "arguments": {}',     # malformed JSON
    "<|tool_call|>[]",                                 # no call
    '<|tool_call|>{"name": "a", "arguments": {}}',     # not a list
    '<tool_call>[{"name": "a", "arguments": 3}]',      # arguments not an object
    'See [{"name": "a", "arguments": {}}]',            # a bare list must start the output
])
def test_granite_plain_content(text):
    assert parse("granite", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("text, content, calls", [
    ('functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     None, [ParsedCall("get_weather", ARGS)]),
    ('Checking. functools[{"name": "a", "arguments": {}}, {"name": "b", "parameters": '
     '{"k": [1]}}]\n', "Checking. ", [ParsedCall("a", "{}"), ParsedCall("b", '{"k": [1]}')]),
])
def test_phi4_mini_json(text, content, calls):
    assert parse("phi4_mini_json", text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("text", [
    "No tools.",
    'functools[{"name": "a", "arguments": {}}',       # unclosed
    "functools[]",                                    # no call
    'functools[{"arguments": {}}]',                   # no name
    'functools[{"name": "a", "arguments": {}}] then',  # text after the list
])
def test_phi4_mini_json_plain_content(text):
    assert parse("phi4_mini_json", text) == ExtractedToolCalls(text, [])


QWEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "hours": {"type": "array"},
        "opts": {"type": ["object", "null"]}, "note": {"type": "string"}}}}}]


def _qwen_call(name: str, params: dict[str, str], close: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return (f"<tool_call>\n<function={name}>\n{body}</function>\n"
            + ("</tool_call>" if close else ""))


def test_qwen3_coder_types_values_by_the_requests_schema():
    """Each value is read as the type the request's tool declares for its key; an
    undeclared key or an unknown function keeps strings; ``null`` is null except for a
    string; a value its type cannot read stays the string written."""
    text = "I will check.\n" + _qwen_call("get_weather", {
        "city": "Paris", "days": "3", "ratio": "0.5", "metric": "True",
        "hours": "[1, 2]", "opts": "{'a': (1, 2)}", "note": "null", "extra": "42"}) \
        + "\n" + _qwen_call("other", {"days": "3"}) + "\n" + _qwen_call("get_weather", {
            "city": "  Oslo\nNorway ", "days": "three", "ratio": "7", "opts": "null",
            "metric": "no"}, close=False)  # the output ended inside its last call
    got = TOOL_PARSERS["qwen3_coder"]().extract(text, QWEN_TOOLS)
    assert got.content == "I will check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "ratio": 0.5, "metric": True,
                         "hours": [1, 2], "opts": {"a": [1, 2]}, "note": "null",
                         "extra": "42"}),
        ("other", {"days": "3"}),
        ("get_weather", {"city": "  Oslo\nNorway ", "days": "three", "ratio": 7,
                         "opts": None, "metric": "no"})]
    assert TOOL_PARSERS["qwen3_coder"]().extract(_qwen_call("get_weather", {"days": "3"})) \
        == ExtractedToolCalls(None, [ParsedCall("get_weather", '{"days": "3"}')])


@pytest.mark.parametrize("text", [
    "No call here.",
    "<tool_call>\n<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>",
    "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",      # no function
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # unclosed
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',           # hermes' JSON
])
def test_qwen3_coder_plain_content(text):
    assert parse("qwen3_coder", text) == ExtractedToolCalls(text, [])


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
    ("pythonic", " [get_", 0),
    ("pythonic", "<|python_st", 0),
    ("pythonic", "Sure: [", len("Sure: [")),
    ("granite", "", 0),
    ("granite", " [{", 0),
    ("granite", "Hi <|tool", len("Hi ")),
    ("granite", "Hi <tool_call>[", len("Hi ")),
    ("qwen3_coder", "Ok <tool_ca", len("Ok ")),
    ("qwen3_coder", "Ok <tool_call>\n<function=", len("Ok ")),
    ("granite", "Hi [x]", len("Hi [x]")),
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


def _defs_tool(name: str, place: dict) -> ChatTool:
    return ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
        "$defs": {"Place": place}}}})


PLACE = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_root_definitions_go_to_the_root_of_the_call_schema():
    """pydantic's ``$defs`` (``#/$defs/NAME`` pointers from the root of the parameters):
    every tool's at the root of the schema of its calls, where the pointers resolve;
    the tools' own parameters untouched."""
    a, b = _defs_tool("a", PLACE), _defs_tool("b", PLACE)
    schema = required_schema([a, b, TOOLS[1]], parallel=True)
    assert schema["$defs"] == {"Place": PLACE}
    assert [item["properties"]["parameters"] for item in schema["items"]["anyOf"]] == [
        {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}}] * 2 + [
        {"type": "object", "properties": {}}]
    assert "$defs" in a.function.parameters
    assert with_definitions(call_schema(a), [a])["$defs"] == {"Place": PLACE}


def test_two_tools_that_define_one_name_differently_are_refused():
    other = {"type": "object", "properties": {"zip": {"type": "string"}}}
    with pytest.raises(APIError) as info:
        required_schema([_defs_tool("a", PLACE), _defs_tool("b", other)], parallel=True)
    assert (info.value.status, info.value.param) == (400, "tools")
    assert "'Place'" in info.value.message


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


STREAMED = [  # (parser, a whole output) that streaming sends piece by piece
    ("hermes", 'Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>'),
    ("hermes", "No tools <b>here</b>."),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {"x": 1}}'),
    ("llama3_json", "Plain {text}."),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "a", "arguments": {}}]'),
    ("pythonic", '[get_weather(city="Paris")]'),
    ("pythonic", "Sure: [1, 2] is a list."),
    ("pythonic", '<|python_start|>[ping(q="x")]<|python_end|>'),
    ("granite", 'Let me look. <|tool_call|>[{"name": "a", "arguments": {}}]'),
    ("granite", ' [{"name": "a", "arguments": {"s": "x"}}]'),
    ("granite", "Hi [x] <tool"),
    ("phi4_mini_json", 'Ok. functools[{"name": "a", "arguments": {}}]'),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"
                    "</function>\n</tool_call>"),
]


@pytest.mark.parametrize("name, text", STREAMED)
def test_what_streaming_sends_early_is_the_final_content(name, text):
    """At every prefix of an output, the content streaming sends at once
    (``content_prefix_len``) is a prefix of the content the whole output parses to, and it
    only grows."""
    parser = TOOL_PARSERS[name]()
    final = parser.extract(text).content or ""
    sent = 0
    for i in range(len(text) + 1):
        n = parser.content_prefix_len(text[:i])
        assert n >= sent and final.startswith(text[:n]), (i, text[:i], n)
        sent = n

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
    '{"city": "Paris"}',                               # no name
    '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": }}',  # a later call
])
def test_llama3_json_plain_content(text):
    assert parse("llama3_json", text) == ExtractedToolCalls(text, [])


@pytest.mark.parametrize("name, text, calls", [
    ("llama3_json", '{"name": "a", "parameters": {}} and more', [ParsedCall("a", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}\n{"name": "b", "parameters": {}}',
     [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {}} ;\n{"name": "b", "parameters": {}}; ok',
     [ParsedCall("a", "{}"), ParsedCall("b", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {}};; {"name": "b", "parameters": {}}',
     [ParsedCall("a", "{}")]),  # a second ';' is other text: the calls ended
    ("llama3_json", '{"name": "a", "parameters": {}} I said {"name": "b", "parameters": {}}',
     [ParsedCall("a", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]\nDone.',
     [ParsedCall("a", '{"x": 1}')]),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {}} {"name": "b", "arguments": {}}',
     [ParsedCall("a", "{}")]),  # one JSON value after the marker
    ("phi4_mini_json", 'functools[{"name": "a", "arguments": {"x": 1}}] then [1]',
     [ParsedCall("a", '{"x": 1}')]),
])
def test_text_after_json_calls_is_ignored(name, text, calls):
    """Text after a JSON format's calls is ignored, whole as streamed: vLLM's parsers
    return the calls (``llama3_json`` every object, ``mistral`` the JSON value it decodes
    at the marker, ``phi4_mini_json`` the ``functools[...]`` list) and drop what follows.
    Llama's calls follow one another after blanks and at most one ``;``; any other text
    ends them."""
    assert parse(name, text) == ExtractedToolCalls(None, calls)


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


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS]add_this_and_that[ARGS]{"a": 3.5, "b": 4}', None,
     [ParsedCall("add_this_and_that", '{"a": 3.5, "b": 4}')]),
    ('Sure. [TOOL_CALLS]add[ARGS]{"a": 1}\n[TOOL_CALLS]mul[ARGS]{"b": {"c": "}"}}', "Sure. ",
     [ParsedCall("add", '{"a": 1}'), ParsedCall("mul", '{"b": {"c": "}"}}')]),
    ('[TOOL_CALLS]add{"a":1}', None, [ParsedCall("add", '{"a":1}')]),  # no [ARGS]
    ('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{}', None, [ParsedCall("add", "{}")]),
    ('[TOOL_CALLS] add [ARGS] {"a": 1} and more', None, [ParsedCall("add", '{"a": 1}')]),
    ('[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]', None, [ParsedCall("add", '{"a": 1}')]),
])
def test_mistral_v11(text, content, calls):
    """Mistral's v11 tokenizers' form (Mistral Small 3.2, Magistral, Devstral), which
    vLLM reads: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call, ``[ARGS]`` optional, an optional
    ``[CALL_ID]ID`` (the model's id is not kept), the arguments as written, text after
    them ignored."""
    assert parse("mistral", text) == ExtractedToolCalls(content, calls)


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]add[ARGS]{"a": 1',                      # left open
    '[TOOL_CALLS]add[ARGS]{"a": one}',                   # not JSON
    '[TOOL_CALLS]add[ARGS]["a"]',                        # not an object
    '[TOOL_CALLS]I will add{"a": 1}',                    # a name with blanks
    '[TOOL_CALLS]add[ARG]{"a": 1}',                      # not a marker
    '[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]mul',            # the second call unfinished
    '[TOOL_CALLS]add{"a": 1}[TOOL_CALLS][{"name": "b", "arguments": {}}]',
])
def test_mistral_v11_plain_content(text):
    """A v11 call that is not complete, or whose name or arguments are not a call's, makes
    the whole output content (vLLM returns such calls as written)."""
    assert parse("mistral", text) == ExtractedToolCalls(text, [])


def test_mistral_call_ids_are_nine_alphanumerics():
    """Mistral's chat templates refuse a tool call id that is not 9 letters and digits
    when the client sends the calls back (vLLM's mistral parser gives its calls such
    ids, ``MistralToolCall``); a forced call's too where the server's parser is mistral
    (vLLM gives it the usual id on the Hugging Face path, whose next turn then fails); the
    usual ``call_`` ids elsewhere."""
    auto = ToolPlan("auto", [], parser=TOOL_PARSERS["mistral"]())
    text = '[TOOL_CALLS]a{}[TOOL_CALLS]b{}'
    ids = [c.id for c in auto.extract(text, "stop")[1]] + [auto.call_id() for _ in range(50)]
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids)
    assert len(set(ids)) == len(ids)
    hermes = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"]())
    assert hermes.call_id().startswith("call_") and len(hermes.call_id()) == 29
    named = ToolPlan("named", [])
    _, calls, _ = named.extract('{"name": "a", "parameters": {}}', "stop")
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    named = ToolPlan("named", [], id_parser=TOOL_PARSERS["mistral"]())
    _, calls, _ = named.extract('{"name": "a", "parameters": {}}', "stop")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum() and named.call_id().isalnum()


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


WEATHER = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "code": {"type": "string"}}}}}]


@pytest.mark.parametrize("body, args", [
    # vLLM's test_extract_tool_calls_missing_closing_parameter_tag
    ("<parameter=city>\nDallas\n<parameter=days>\n3\n</parameter>\n</function>",
     {"city": "Dallas", "days": 3}),
    ("<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n3\n</function>",
     {"city": "Dallas", "days": 3}),
    ("<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n3\n",
     {"city": "Dallas", "days": 3}),
    # only a <parameter= that starts a line ends a value; a </function> not at the call's
    # end is the value's own text
    ("<parameter=code>\nx = '<parameter=days>'\n</function> y\n</parameter>\n</function>",
     {"code": "x = '<parameter=days>'\n</function> y"}),
    ("<parameter=code>\nx = '<parameter=days>'\n</function>", {"code": "x = '<parameter=days>'"}),
])
def test_qwen3_coder_a_value_missing_its_end_tag(body, args):
    """A value whose ``</parameter>`` the model left out ends before the next
    ``<parameter=`` that starts a line, or at the call's end (vLLM ends it at the next
    ``<parameter=``, at ``</function>`` or at the output's end; its structural reading,
    like this one, takes only a ``<parameter=`` that starts a line and a ``</function>``
    that ends the call): the next parameter is its own member, and the call is a call."""
    for tail in ("\n</tool_call>", ""):
        text = "Hi.\n<tool_call>\n<function=weather>\n" + body + tail
        got = TOOL_PARSERS["qwen3_coder"]().extract(text, WEATHER)
        assert (got.content, [(c.name, json.loads(c.arguments)) for c in got.calls]) == (
            "Hi.\n", [("weather", args)])


@pytest.mark.parametrize("text, content, names", [
    # vLLM's test_extract_tool_calls_fallback_no_tags and ..._streaming_missing_opening_tag
    ("I'll check.\n\n<function=weather>\n<parameter=city>\nDallas\n</parameter>\n"
     "</function>\n</tool_call>", "I'll check.\n\n", ["weather"]),
    ("<function=weather>\n</function>", None, ["weather"]),
    # only the first call may lack its tag; what follows a call up to a <tool_call> is not
    # read (vLLM reads one tagless call)
    ("<function=a>\n</function>\n<function=b>\n</function>", None, ["a"]),
    ("<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n"
     "</tool_call>", None, ["a", "b"]),
    ("<tool_call>\n<function=a>\n</function>\n</tool_call>\n<function=b>\n</function>",
     None, ["a"]),
])
def test_qwen3_coder_a_call_without_its_tool_call_tag(text, content, names):
    """A first ``<function=...>`` without ``<tool_call>`` is a call (vLLM's back-off when
    an output has no tool-call tags), the text before it content."""
    got = TOOL_PARSERS["qwen3_coder"]().extract(text, WEATHER)
    assert (got.content, [c.name for c in got.calls]) == (content, names)


def test_qwen3_coder_type_names_as_vllm_normalizes_them():
    """vLLM reads a declared type by its name's family: ``int*``, ``uint*``, ``long*``,
    ``short*``, ``unsigned*`` integers; ``num*``, ``float*`` numbers; ``bool``, ``binary``
    booleans; ``arr``, ``list*`` arrays, ``dict*`` objects; ``str``, ``text``, ``varchar``,
    ``char``, ``enum`` strings (case and blanks aside). A value JSON cannot hold (``inf``)
    stays the string written."""
    types = {"i": "int", "u": "uint32", "l": "long", "s": "short", "n": "unsigned int",
             "f": "float", "g": "Float64", "m": "num", "b": "bool", "y": "binary",
             "a": "arr", "t": "list[str]", "d": "dict", "e": " Dictionary ", "x": "text",
             "v": "varchar", "c": "char", "z": "enum", "w": "widget", "q": "number"}
    values = {"i": "4", "u": "5", "l": "6", "s": "7", "n": "8", "f": "3.5", "g": "2",
              "m": "-1e3", "b": "True", "y": "false", "a": "[1]", "t": "['x']",
              "d": '{"k": 1}', "e": "{'k': (1,)}", "x": "7", "v": "true", "c": "[1]",
              "z": "null", "w": "5", "q": "inf"}
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"properties": {
        k: {"type": v} for k, v in types.items()}}}}]
    got = TOOL_PARSERS["qwen3_coder"]().extract(_qwen_call("t", values), tools)
    assert json.loads(got.calls[0].arguments) == {
        "i": 4, "u": 5, "l": 6, "s": 7, "n": 8, "f": 3.5, "g": 2, "m": -1000.0, "b": True,
        "y": False, "a": [1], "t": ["x"], "d": {"k": 1}, "e": {"k": [1]}, "x": "7",
        "v": "true", "c": "[1]", "z": "null", "w": "5", "q": "inf"}


@pytest.mark.parametrize("text", [
    "No call here.",
    "<tool_call>\n<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>",
    "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>",      # no function
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>',           # hermes' JSON
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray\n</function>",
    "Use <function=f> like this.",                     # text inside a tagless call
    "<tool_call>\n<function=f>\n</function>\n</tool_call><tool_call>\n</tool_call>",
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
    ("qwen3_coder", "Ok <func", len("Ok ")),
    ("qwen3_coder", "Ok <function=f>", len("Ok ")),
    ("qwen3_coder", "Ok <b>", len("Ok <b>")),
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
    ("qwen3_coder", "Sure.\n<function=f>\n<parameter=a>\n1\n</function>"),
    ("qwen3_coder", "Use <function=f> here."),
    ("mistral", 'Ok. [TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b{}'),
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

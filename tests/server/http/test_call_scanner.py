"""``CallScanner``: calls read from JSON text fed piece by piece. Whatever the pieces, the
events add up to the same calls: a streamable call's arguments exactly as written, others
whole; and a tool plan's whole answer keeps the arguments the stream sent."""

from __future__ import annotations

import json
import random

import pytest

from tpserve.server.http.call_scanner import (
    CallArguments,
    CallEnd,
    CallScanner,
    CallStart,
    CallStream,
    MarkedCalls,
    streamed_arguments,
)
from tpserve.server.http.tool_parsers import TOOL_PARSERS
from tpserve.server.http.tool_parsers.hermes import HermesToolParser
from tpserve.server.http.tools import ToolPlan

WEATHER_ARGS = '{"city": "Pa\\"ris {not a brace}", "days": [1, {"x": [2]}], "u": "°C"}'
NAMED = '{"name": "get_weather", "parameters": ' + WEATHER_ARGS + '}'
SPACED = '{ "name" :"f",\n  "parameters" :  { }\n}'
MIXED = ('[{"name": "a", "parameters": {"k": "}]"}}, '
         '{"parameters": {"x": 1}, "name": "b"}, '  # its name after its arguments
         '{"name": "c", "parameters": "{\\"y\\": 2}"}, '  # arguments as a JSON text
         '{"name": "d"}, '  # no arguments
         '{"name": "e", "parameters": {}}]')


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def calls_of(scanner: CallStream, parts: list[str]) -> list[tuple]:
    """The calls the events describe, checking the events' order on the way: a start
    before its arguments, arguments only between start and end, one end per call."""
    calls: dict[int, list] = {}
    for events in [*(scanner.feed(part) for part in parts), scanner.finish()]:
        for e in events:
            if isinstance(e, CallStart):
                assert e.index not in calls
                calls[e.index] = ["streamed", e.name, "", False]
            elif isinstance(e, CallArguments):
                assert calls[e.index][0] == "streamed" and not calls[e.index][3] and e.text
                calls[e.index][2] += e.text
            else:
                assert isinstance(e, CallEnd)
                if e.streamed:
                    assert calls[e.index][1] == e.name and not calls[e.index][3]
                    calls[e.index][3] = True
                else:
                    assert e.index not in calls
                    calls[e.index] = ["whole", e.name, e.arguments, True]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(40))
def test_any_pieces_give_the_same_calls(seed):
    rng = random.Random(seed)
    assert calls_of(CallScanner(1, ("parameters",)), pieces(NAMED, rng)) == [
        ("streamed", "get_weather", WEATHER_ARGS, True)]
    assert calls_of(CallScanner(1, ("parameters",)), pieces(SPACED, rng)) == [
        ("streamed", "f", "{ }", True)]
    assert calls_of(CallScanner(2, ("parameters",)), pieces(MIXED, rng)) == [
        ("streamed", "a", '{"k": "}]"}', True),
        ("whole", "b", '{"x": 1}', True),
        ("whole", "c", '"{\\"y\\": 2}"', True),
        ("whole", "d", None, True),
        ("streamed", "e", "{}", True)]


def test_arguments_go_out_as_soon_as_written():
    scanner = CallScanner(1, ("arguments",))
    assert scanner.feed('{"name": "f", "argu') == []
    assert scanner.feed('ments": {"a"') == [CallStart(0, "f"), CallArguments(0, '{"a"')]
    assert scanner.feed(": 1") == [CallArguments(0, ": 1")]
    assert scanner.feed("}") == [CallArguments(0, "}")]
    assert scanner.feed("}") == [CallEnd(0, True, "f", None)]
    cut = CallScanner(1, ("arguments",))  # cut short: what was written, and no end
    assert cut.feed('{"name": "f", "arguments": {"a": [1, 2') == [
        CallStart(0, "f"), CallArguments(0, '{"a": [1, 2')]


@pytest.mark.parametrize("seed", range(10))
def test_then_says_what_may_follow_the_calls(seed):
    """``then``: with ``";"`` (llama3_json's) objects follow one another after blanks and
    at most one ``;``, and any other text ends the reading; with ``""`` (mistral's and
    phi4_mini_json's) one value is read, nothing after it; without it, every call object
    of the text is read. vLLM's parsers of these formats return the calls and ignore the
    text after them."""
    rng = random.Random(seed)
    a, b = '{"name": "a", "parameters": {}}', '{"name": "b", "parameters": {"x": 1}}'
    names = [("streamed", "a", "{}", True), ("streamed", "b", '{"x": 1}', True)]
    for then, text, count in [(";", f" {a} ;\n{b}", 2), (";", f"{a}{b}", 2),
                              (";", f"{a};;{b}", 1), (";", f"{a} so {b}", 1),
                              (";", f"so {a}", 0), ("", f"{a} {b}", 1), ("", f"{a};{b}", 1),
                              (None, f"{a} so {b}", 2)]:
        assert calls_of(CallScanner(1, ("parameters",), then), pieces(text, rng)) == (
            names[:count]), (then, text)
    assert calls_of(CallScanner(2, ("parameters",), ""), pieces(f"[{a}] [{b}]", rng)) == (
        names[:1])


def test_streamed_arguments_of_a_whole_text():
    assert streamed_arguments(CallScanner(2, ("parameters",)), MIXED) == [
        ("a", '{"k": "}]"}'), ("b", None), ("c", None), ("d", None), ("e", "{}")]


def test_a_plans_whole_calls_keep_the_arguments_as_streamed():
    named = ToolPlan("named", [])
    _, calls, finish = named.extract(NAMED, "stop")
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", WEATHER_ARGS)]
    assert finish == "stop"
    required = ToolPlan("required", [])
    text = ('[{"name": "a", "parameters": {"k":1}}, '
            '{"parameters": {"x":  1}, "name": "b"}]')
    _, calls, finish = required.extract(text, "stop")
    # a's arguments as written (and streamed); b's could not stream: re-encoded
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", '{"k":1}'), ("b", json.dumps({"x": 1}))]
    assert finish == "tool_calls"
    assert ToolPlan("none", []).call_stream() is None


HERMES = ('Let me check. <tool_call>\n{"name": "a", "arguments": {"q": "</tool", "n": 1}}\n'
          '</tool_call>\n<tool_call>{"arguments": {}, "name": "b"}</tool_call>'
          '<tool_call>{"name": "c", "arguments": {"k": [1, 2]}')  # left open: read to the end


@pytest.mark.parametrize("seed", range(20))
def test_marked_calls_read_only_what_lies_between_the_markers(seed):
    got = calls_of(MarkedCalls("<tool_call>", "</tool_call>", ("arguments",)),
                   pieces(HERMES, random.Random(seed)))
    # c's object never closes (whole, the output does not parse): held, never reported
    assert got == [("streamed", "a", '{"q": "</tool", "n": 1}', True),
                   ("whole", "b", "{}", True)]


@pytest.mark.parametrize("stream", [
    lambda: MarkedCalls("<tool_call>", "</tool_call>", ("arguments",)),
    lambda: TOOL_PARSERS["mistral"]().call_stream()], ids=["marked", "after-marker"])
def test_free_output_calls_are_reported_when_they_close_and_parse(stream):
    """A model's own JSON (``tool_choice: auto``) may not parse: a streamable call is held
    until it closes, then reported whole (its arguments in one piece, as written) if its
    arguments parse, else not at all; a call the output leaves open, never."""
    opening = "<tool_call>" if isinstance(stream(), MarkedCalls) else "[TOOL_CALLS]"
    good = stream()
    assert good.feed(opening + '{"name": "f", "arguments": {"a"') == []
    assert good.feed(': [1, "}"]}') == []
    assert good.feed("}") == [CallStart(0, "f"), CallArguments(0, '{"a": [1, "}"]}'),
                              CallEnd(0, True, "f", None)]
    bad = stream()
    assert bad.feed(opening + '{"name": "f", "arguments": {"city": Paris}') == []
    assert bad.feed("}") + bad.finish() == []
    cut = stream()
    assert cut.feed(opening + '{"name": "f", "arguments": {"a": 1}') + cut.finish() == []


def test_hermes_whole_calls_keep_the_arguments_as_streamed():
    plan = ToolPlan("auto", [], parser=HermesToolParser())
    content, calls, finish = plan.extract(HERMES.replace('"k": [1, 2]', '"k": [1,2]}'), "stop")
    assert (content, finish) == ("Let me check. ", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", '{"q": "</tool", "n": 1}'), ("b", "{}"), ("c", '{"k": [1,2]}')]
    _, calls, _ = plan.extract('<tool_call>{"arguments": {"x":  1}, "name": "b"}', "stop")
    assert calls[0].function.arguments == '{"x": 1}'  # could not stream: re-encoded


# each JSON format's calls (the parser's own layout), and outputs it reads as content only
CALLS = {
    "hermes": 'Sure. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
              '<tool_call>\n{"name": "b", "arguments": {"y": "}]"}}\n</tool_call>',
    "mistral": 'Ok[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, '
               '{"name": "b", "arguments": {"y": [1,  {"z": null}]}}]',
    "granite": '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}]',
    "phi4_mini_json": 'Calling. functools[{"name": "a", "arguments": {"x": 1}}, '
                      '{"name": "b", "arguments": {}}]',
    "llama3_json": '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                   '{"name": "b", "parameters": {"z": "a;b"}}',
    "pythonic": '[get_weather(city="Paris, ]France", unit=\'c\'), ping(), '
                'f(x=[1, (2, 3)], y={"a": "]"})]',
    "qwen3_coder": 'Sure. <tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n'
                   '<parameter=y>\nline one\nline "two"\n</parameter>\n</function>\n'
                   '</tool_call>\n<tool_call>\n<function=b>\n</function>\n</tool_call>',
}
MORE_CALLS = [("mistral", '[TOOL_CALLS] {"name": "a", "arguments": {"x": 1}}'),
              ("granite", ' [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'),
              ("llama3_json", '  {"name": "a", "parameters": {"x":1}}'),
              ("pythonic", '<|python_start|> [f(a="x,y")]<|python_end|>'),
              # left open by the output's end, which the format reads as a call
              ("qwen3_coder", '<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n'),
              # a first call without its <tool_call>; a value without its </parameter>
              ("qwen3_coder", 'Write <function=a>\n<parameter=x>\n1\n</parameter>\n</function>'),
              ("qwen3_coder", '<tool_call>\n<function=a>\n<parameter=x>\n1\n<parameter=y>\n'
                              'two\n</function>\n</tool_call>'),
              ("mistral", 'Ok[TOOL_CALLS]a[ARGS]{"x": "}"}[TOOL_CALLS]b[CALL_ID]x1y2z3w4v{}'),
              # text after the calls, which the format ignores
              ("llama3_json", '{"name": "a", "parameters": {"x":1}}; {"name": "b", "parameters": {}}'
                              ' Thanks! {"name": "c", "parameters": {}}'),
              ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}] [{"name": "b"}]'),
              ("phi4_mini_json", 'functools[{"name": "a", "arguments": {}}] [{"name": "b"}]')]
CONTENT = [("hermes", 'no call here {"name": "a", "arguments": {}}'),
           ("hermes", 'Try <tool_call>{"name": "a", "arguments": {"x": y}}</tool_call>'),
           ("hermes", 'Cut <tool_call>{"name": "a", "arguments": {"x": [1'),
           ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 01}}]'),
           ("granite", '<|tool_call|>[{"name": "a", "arguments": {"x": tru}}]'),
           ("llama3_json", '{"name": "a", "parameters": {"x": "\\q"}}'),
           ("granite", 'Use [{"name": "a", "arguments": {}}] here'),
           ("phi4_mini_json", 'see functools.partial({"name": "a", "arguments": {}})'),
           ("llama3_json", 'I would call {"name": "a", "parameters": {}}'),
           ("llama3_json", '<|python_ta is not a tag {"name": "a", "parameters": {}}'),
           ("llama3_json", 'As said: <|python_tag|>{"name": "a", "parameters": {}}'),
           ("pythonic", 'Call [f(a=1)] now'),
           ("pythonic", '[f(1), g(a=2)]'),  # a positional argument: no call at all
           ("qwen3_coder", 'Write <function=a> like that, or <tool_call>'),
           ("qwen3_coder", '<tool_call>\n<function=a>\nstray\n<parameter=x>\n1\n</parameter>'),
           ("mistral", '[TOOL_CALLS]a[ARGS]{"x": one}'),
           ("llama3_json", '<|python_tag|>[{"name": "a", "parameters": {}}]')]


@pytest.mark.parametrize(("parser", "text"), [*CALLS.items(), *MORE_CALLS])
@pytest.mark.parametrize("seed", range(5))
def test_a_formats_streamed_calls_are_its_whole_calls(parser, text, seed):
    """Streamed in any pieces, every call of the output streams, with the arguments the
    whole answer holds."""
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS[parser]())
    _, whole, finish = plan.extract(text, "stop")
    assert finish == "tool_calls" and whole
    stream = plan.call_stream()
    assert stream is not None
    got = calls_of(stream, pieces(text, random.Random(seed)))
    assert got == [("streamed", c.function.name, c.function.arguments, True) for c in whole]


@pytest.mark.parametrize(("parser", "text"), CONTENT)
def test_an_output_read_as_content_streams_no_call(parser, text):
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS[parser]())
    assert plan.extract(text, "stop") == (text, [], "stop")
    for seed in range(5):
        stream = plan.call_stream()
        assert stream is not None
        assert calls_of(stream, pieces(text, random.Random(seed))) == []




def test_qwen3_coder_arguments_grow_a_parameter_at_a_time_typed_by_the_tool():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integer"}, "tags": {"type": "array"}, "s": {"type": "string"}}}}}]
    plan = ToolPlan("auto", tools, parser=TOOL_PARSERS["qwen3_coder"]())
    text = ('<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n'
            '<parameter=tags>\n["a", "é"]\n</parameter>\n<parameter=s>\n7\n</parameter>\n'
            '</function>\n</tool_call>')
    stream = plan.call_stream()
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert [e.text for e in events if isinstance(e, CallArguments)] == [
        "{", '"n": 42', ', "tags": ["a", "é"]', ', "s": "7"', "}"]
    _, calls, _ = plan.extract(text, "stop")
    assert calls[0].function.arguments == '{"n": 42, "tags": ["a", "é"], "s": "7"}'

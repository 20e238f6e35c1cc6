"""A streamed choice whose output may hold tool calls (``streaming._HeldChoice``), fed
deltas directly: content, calls and the finish in one delta come out in that order, and
the deltas of any split add up to the whole answer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tpserve.server.engine.outputs import CompletionDelta
from tpserve.server.http.streaming import _HeldChoice
from tpserve.server.http.tool_parsers import TOOL_PARSERS
from tpserve.server.http.tools import ToolPlan

OUTPUT = ('Let me look. <tool_call>\n{"name": "a", "arguments": {"x": "1"}}\n</tool_call>\n'
          '<tool_call>\n{"arguments": {"y": 2}, "name": "b"}\n</tool_call>')


def run(plan: ToolPlan, parts: list[str]) -> list:
    ctx = SimpleNamespace(tools=plan, logprobs=False)
    held, deltas = _HeldChoice(plan), []
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        d = CompletionDelta(0, part, (), finish_reason="stop" if last else None)
        deltas += [delta for delta, _ in held.add(d, ctx)]
    return deltas, held.finish_reason


def added_up(deltas) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for delta in deltas:
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc["index"], ["", ""])
            call[0] += tc.get("function", {}).get("name") or ""
            call[1] += tc.get("function", {}).get("arguments") or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_content_calls_and_finish_in_one_delta_come_in_order():
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"]())
    deltas, finish = run(plan, [OUTPUT])
    assert finish == "tool_calls"
    assert deltas[0].content == "Let me look. " and not deltas[0].tool_calls
    assert added_up(deltas) == ("Let me look. ", [("a", '{"x": "1"}'), ("b", '{"y": 2}')])
    # a streamed (as written), b whole at the end (its name came after its arguments)
    assert [tc.get("id") is not None for d in deltas[1:] for tc in d.tool_calls] == [
        True, False, True]


@pytest.mark.parametrize("seed", range(10))
def test_any_split_adds_up_to_the_whole_answer(seed):
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"]())
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(OUTPUT)), 15))
    parts = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)], strict=True)]
    deltas, finish = run(plan, parts)
    content, calls, whole_finish = plan.extract(OUTPUT, "stop")
    assert finish == whole_finish == "tool_calls"
    assert added_up(deltas) == (content, [(c.function.name, c.function.arguments)
                                          for c in calls])


@pytest.mark.parametrize("seed", range(5))
def test_parallel_tool_calls_false_streams_the_first_call_only(seed):
    """``parallel_tool_calls: false`` (vLLM's ``maybe_filter_parallel_tool_calls``): the
    first call only, whole and streamed, whatever the split."""
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"](), parallel=False)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(OUTPUT)), 15))
    parts = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)], strict=True)]
    content, calls, whole_finish = plan.extract(OUTPUT, "stop")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", '{"x": "1"}')]
    deltas, finish = run(plan, parts)
    assert finish == whole_finish == "tool_calls"
    assert added_up(deltas) == (content, [("a", '{"x": "1"}')])
    assert {tc["index"] for d in deltas for tc in d.tool_calls or ()} == {0}


BAD = 'Let me look. <tool_call>\n{"name": "a", "arguments": {"x": one}}\n</tool_call>'


@pytest.mark.parametrize("seed", range(10))
def test_a_call_whose_arguments_do_not_parse_streams_as_content(seed):
    """Whole, a hermes call whose arguments are not JSON makes the output all content; the
    stream holds the call until it closes, finds it does not parse, and sends nothing of
    it: its deltas add up to the same content."""
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"]())
    assert plan.extract(BAD, "stop") == (BAD, [], "stop")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(BAD)), 12))
    parts = [BAD[a:b] for a, b in zip([0, *cuts], [*cuts, len(BAD)], strict=True)]
    deltas, finish = run(plan, parts)
    assert (added_up(deltas), finish) == ((BAD, []), "stop")


def test_a_stream_that_sent_a_call_finishes_with_tool_calls():
    """A call went out whole (its id, name and arguments) before a later call of the output
    turned out not to parse: the choice still ends "tool_calls", as vLLM's stream ends one
    that streamed tools (the whole answer reads no calls there: the output is content)."""
    bad = ('<tool_call>\n{"name": "a", "arguments": {"x": "1"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {"y": Rome}}\n</tool_call>')
    plan = ToolPlan("auto", [], parser=TOOL_PARSERS["hermes"]())
    cut = bad.index("<tool_call>", 5)
    deltas, finish = run(plan, [bad[:cut], bad[cut:]])
    assert added_up(deltas)[1][0] == ("a", '{"x": "1"}')
    assert finish == "tool_calls"
    assert plan.extract(bad, "stop") == (bad, [], "stop")


WEATHER = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "int"}}}}}]
SPLIT = [  # (parser, the request's tools, an output with calls)
    ("qwen3_coder", WEATHER, "Let me check:\n<tool_call>\n<function=weather>\n"
     "<parameter=city>\nDallas\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", WEATHER, "<tool_call>\n<function=weather>\n<parameter=city>\nDallas\n"
     "</parameter>\n<parameter=days>\n3\n</function>\n</tool_call>"),
    ("qwen3_coder", WEATHER, "I'll check.\n\n<function=weather>\n<parameter=city>\nDallas\n"
     "</parameter>\n</function>\n</tool_call>"),
    ("llama3_json", [], '{"name": "a", "parameters": {"q": "x"}}\n{"name": "b", "parameters": '
     '{}} Would you like more?'),
    ("mistral", [], '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]\nDone.'),
    ("mistral", [], 'Ok. [TOOL_CALLS]add[ARGS]{"a": 3.5}[TOOL_CALLS]mul[CALL_ID]abcdefghi'
     '[ARGS]{"b": 6}'),
    ("phi4_mini_json", [], 'functools[{"name": "a", "arguments": {"x": 1}}]\nDone.'),
]


@pytest.mark.parametrize("name, tools, text", SPLIT)
@pytest.mark.parametrize("seed", range(8))
def test_a_streamed_answer_is_the_whole_answer(name, tools, text, seed):
    """A value missing its ``</parameter>``, a Qwen call missing its ``<tool_call>``, text
    after JSON calls, Mistral's v11 form: whatever the split, the stream's content, calls
    and finish reason are the whole answer's (vLLM's whole-answer parsers return these
    calls; its streams send them), each call with one id; Mistral's ids are 9 letters and
    digits (vLLM's ``MistralToolCall``), which Mistral's chat templates insist on."""
    plan = ToolPlan("auto", tools, parser=TOOL_PARSERS[name]())
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), len(text) - 1 if seed == 0 else 12))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas, finish = run(plan, parts)
    content, calls, whole_finish = plan.extract(text, "stop")
    assert calls and finish == whole_finish == "tool_calls"
    assert added_up(deltas) == (content or "", [(c.function.name, c.function.arguments)
                                                for c in calls])
    ids = [tc["id"] for d in deltas for tc in d.tool_calls or () if tc.get("id")]
    assert len(ids) == len(set(ids)) == len(calls)
    if name == "mistral":
        assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids + [
            c.id for c in calls])

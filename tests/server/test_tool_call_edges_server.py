"""Chat tool calling and reasoning at their edges, on real servers (SmolLM2 with
``--enable-auto-tool-choice --tool-call-parser hermes``, and the thinking SmolLM2 with
``--reasoning-parser qwen3``), each as the OpenAI reference and vLLM give it (a review
found each wrong):

- ``parallel_tool_calls: false`` under ``tool_choice: auto`` keeps the first call only
  (vLLM's ``maybe_filter_parallel_tool_calls``), whole and streamed;
- a tool whose ``parameters`` use ``$defs`` / ``$ref`` (what pydantic, and so the openai
  SDK's ``pydantic_function_tool``, writes) is called under ``tool_choice`` required or
  named: the ``$defs`` go to the root of the call schema, as vLLM's;
- ``--reasoning-parser qwen3``: an output that does not begin with ``<think>`` is all
  answer, so a forced call's grammar applies from its first token; one that thinks
  first gets the call after ``</think>``;
- a hermes call (auto) whose arguments are not JSON is content, streamed as whole.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.server.serverproc import SMALL, ServerProcess, stopped_on_exit
from tests.server.thinking_model import write_thinking_smollm2

ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
        "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
# two hermes calls, one after the other (a small model calls no tool on its own)
TWO_CALLS = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}'
             '\\n</tool_call>\\n<tool_call>\\n\\{"name": "get_time", "arguments": '
             '\\{"tz": "CET"\\}\\}\\n</tool_call>')


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_thinking_smollm2(tmp_path_factory.mktemp("thinking") / "SmolLM2-thinking")


@pytest.fixture(scope="module")
def servers(folder):
    with stopped_on_exit({
        "hermes": ServerProcess(*SMALL, "--enable-auto-tool-choice", "--tool-call-parser",
                                "hermes", wait=False),
        "qwen3": ServerProcess(str(folder), "--reasoning-parser", "qwen3",
                               "--no-engine-process", wait=False),
    }) as started:
        for s in started.values():
            s.wait_until_healthy()
        yield started


def _client(server):
    c = server.client(timeout=600)
    return c, c.models.list().data[0].id


def _streamed(client, **kwargs) -> tuple[str, dict[int, dict], list[str]]:
    """A streamed chat answer's content, its calls by index (names and arguments as the
    pieces add up) and its finish reasons."""
    content, calls, finish = "", {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_keeps_the_first_auto_call(servers, stream):
    """OpenAI: ``parallel_tool_calls`` "Whether to enable parallel function calling during
    tool use"; vLLM (``maybe_filter_parallel_tool_calls``): when it is false, only the
    first call (index 0) is returned, whole and streamed. tpserve honours it only for
    ``required`` (its grammar); under ``auto`` both calls come back."""
    c, model = _client(servers["hermes"])
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                  temperature=0, max_tokens=100, extra_body={"guided_regex": TWO_CALLS})
    if stream:
        _, calls, finish = _streamed(c, **kwargs)
        assert finish == ["tool_calls"]
        assert [(i, call["name"], call["arguments"]) for i, call in calls.items()] == [
            (0, "get_weather", '{"city": "Paris"}')]
    else:
        choice = c.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments)
                for t in choice.message.tool_calls] == [("get_weather", '{"city": "Paris"}')]


DEFS_PARAMS = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}},
               "required": ["where"],
               "$defs": {"Place": {"type": "object",
                                   "properties": {"city": {"type": "string",
                                                           "maxLength": 10}},
                                   "required": ["city"]}}}
DEFS_TOOL = [{"type": "function", "function": {"name": "locate", "parameters": DEFS_PARAMS}}]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "locate"}}],
    ids=["required", "named"])
def test_a_forced_call_of_a_tool_whose_schema_uses_defs(servers, tool_choice):
    """A pydantic-generated parameters schema (``$defs`` and ``#/$defs/...`` refs, as the
    openai SDK's ``pydantic_function_tool`` sends) is a valid JSON schema that OpenAI
    accepts; vLLM hoists every tool's ``$defs`` to the root of the ``required`` schema
    and uses the parameters schema itself for a named function. tpserve embeds the
    parameters under ``properties.parameters`` of its call schema, where the root
    pointer ``#/$defs/Place`` no longer resolves: a 400 "invalid JSON schema in tools:
    Cannot find field '$defs' in #/$defs/Place"."""
    c, model = _client(servers["hermes"])
    r = c.chat.completions.create(model=model, messages=ASK, tools=DEFS_TOOL,
                                  tool_choice=tool_choice, temperature=0, max_tokens=100)
    calls = r.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["locate"]
    jsonschema.validate(json.loads(calls[0].function.arguments), DEFS_PARAMS)


CAPITAL = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}


FORCED = [{"type": "function", "function": {"name": "capital"}}, "required"]


def _forced_capital(server, tool_choice, content: str, **extra):
    c, model = _client(server)
    return c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=64, tool_choice=tool_choice,
        tools=[{"type": "function", "function": {"name": "capital", "parameters": CAPITAL}}],
        **extra)


@pytest.mark.parametrize("tool_choice", FORCED, ids=["named", "required"])
def test_qwen3_forced_call_when_the_output_does_not_think(servers, folder, tool_choice):
    """``--reasoning-parser qwen3``: an output that does not begin with ``<think>`` is all
    answer (tpserve's own split gives it as ``content``), so a forced tool call must
    constrain it from its first token (OpenAI: ``required`` "means the model must call
    one or more tools"; a named function "forces the model to call that tool"). tpserve
    gated the call's grammar on ``</think>`` (``ReasoningPlan.grammar_after``), which such
    an output never writes: the call was missing and the free text came back as content
    (finish reason "length"). The first token may be ``<think>`` or the call's; this
    model's own choice would be ``<think>`` (``test_qwen3_forced_call_after_thinking``),
    so ``logit_bias`` takes it away here."""
    think = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<think>")
    r = _forced_capital(servers["qwen3"], tool_choice,
                        "Give me a JSON object describing a cat.",
                        logit_bias={str(think): -100})
    m = r.choices[0].message
    assert m.reasoning is None
    assert [t.function.name for t in m.tool_calls] == ["capital"], (m.content, r.choices[0])
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), CAPITAL)
    assert m.content is None


@pytest.mark.parametrize("tool_choice", FORCED, ids=["named", "required"])
def test_qwen3_forced_call_after_thinking(servers, tool_choice):
    """The same forced call where the output begins with ``<think>`` (this model's answer
    to the question is ``<think> capital of France</think> Paris.``): the thinking is free
    and comes back as the reasoning, the call follows ``</think>``."""
    r = _forced_capital(servers["qwen3"], tool_choice, "What is the capital of France?")
    m = r.choices[0].message
    assert m.reasoning == " capital of France"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("capital", {"city": "Paris"})]
    assert m.content is None


# one hermes call whose arguments are not JSON (an unquoted string): no call at all
BAD_CALL = ('Let me check\\. <tool_call>\\n\\{"name": "get_weather", "arguments": '
            '\\{"city": Paris\\}\\}\\n</tool_call>')


def test_a_hermes_call_with_invalid_json_streams_as_the_whole_answer(servers):
    """The whole answer reads the malformed call as no call (the output is content,
    finish reason "stop"), as vLLM's hermes parser does. Streamed, tpserve sends a tool
    call ``get_weather`` whose argument pieces concatenate to ``{"city": Paris}`` (not
    JSON), drops the rest of the content, and still ends with "stop": the stream's
    pieces do not add up to the whole answer, and the tool call's arguments are invalid."""
    c, model = _client(servers["hermes"])
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                  extra_body={"guided_regex": BAD_CALL})
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls == []
    assert whole.finish_reason == "stop"
    content, calls, finish = _streamed(c, **kwargs)
    for call in calls.values():
        json.loads(call["arguments"])  # what a client does with a streamed call
    assert (content, calls, finish) == (whole.message.content, {}, [whole.finish_reason])

"""Tool calling through a real ``tpserve serve`` of SmolLM2 and the openai client:
``tool_choice`` required and named (constrained, so the arguments always follow the
tool's schema), whole and streamed, a round trip with the tool's result in the history,
and the ``--enable-auto-tool-choice`` wiring."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess, stopped_on_exit

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": desc,
                                           "parameters": SCHEMAS[name]}}
         for name, desc in (("get_weather", "Current weather in a city"),
                            ("get_time", "Current time in a timezone"))]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def servers(small_server_8_seqs):
    """The module's servers, started together (see ServerProcess): the plain one (the
    session's SMALL server with --max-num-seqs 8, shared with test_batching: the requests
    here only read their own answers), one with ``--enable-auto-tool-choice
    --tool-call-parser hermes``, and one with the flag but not the parser (which must refuse
    to start)."""
    with stopped_on_exit({
        "auto": ServerProcess(*SMALL, "--enable-auto-tool-choice", "--tool-call-parser",
                              "hermes", wait=False),
        "no-parser": ServerProcess(*SMALL, "--enable-auto-tool-choice", timeout=60,
                                   wait=False),
    }) as started:
        yield {"plain": small_server_8_seqs, **started}


@pytest.fixture(scope="module")
def server(servers):
    return servers["plain"].wait_until_healthy()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=600)


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def streamed(client, **kwargs):
    """(content, tool calls as (id, name, arguments), finish reason) reassembled from the
    stream's deltas."""
    content, calls, finish = "", {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "",
                                               "pieces": 0})
            assert tc.id is None or call["id"] is None  # once, in the call's first delta
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
                call["pieces"] += bool(tc.function.arguments)
        if chunk.choices[0].finish_reason is not None:
            finish.append(chunk.choices[0].finish_reason)
    assert list(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], finish


def test_required(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_required_single_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1
    check_calls(r.choices[0].message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named(client, name):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": name}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's for a forced function
    assert choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == [name]
    check_calls(choice.message.tool_calls, (name,))


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"])
def test_streamed_matches_whole(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  temperature=0, max_tokens=200)
    with ThreadPoolExecutor(2) as pool:  # the same greedy request, whole and streamed
        whole = pool.submit(client.chat.completions.create, **kwargs)
        content, calls, finish = pool.submit(streamed, client, **kwargs).result()
        whole = whole.result().choices[0]
    assert content == ""
    assert finish == [whole.finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)
    # the arguments came as the model wrote them, a token's characters at a time
    assert all(c["pieces"] >= 8 for c in calls), calls


def test_a_call_cut_short_streams_what_was_written(client):
    """``max_tokens`` cuts the forced call: whole, the output does not parse and comes back
    as content; streamed, the call's start and the arguments written so far went out, or,
    cut before its arguments began, the output as content as well."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=24,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    content, calls, finish = streamed(client, **kwargs)
    assert content == "" and finish == ["length"]
    assert [c["name"] for c in calls] == ["get_weather"]
    assert calls[0]["arguments"].startswith("{")
    assert whole.message.content.endswith(calls[0]["arguments"])
    kwargs["max_tokens"] = 16  # '{"name": "get_weather", "p'
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert "parameters" not in whole.message.content
    assert streamed(client, **kwargs) == (whole.message.content, [], ["length"])


def test_round_trip(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = r.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    assert history[1]["role"] == "assistant" and history[1]["tool_calls"][0]["id"] == call.id
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content
    assert choice.message.tool_calls is None
    # without tools at all, the same history is accepted too
    r = client.chat.completions.create(model=MODEL, messages=history, temperature=0,
                                       max_tokens=40)
    assert r.choices[0].message.content == choice.message.content


@pytest.mark.parametrize("body, message", [
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set"),
    ({"tools": TOOLS, "tool_choice": "auto"},
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' has not been passed in `tools`."),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice 'required' or a named function cannot be combined with another "
     "structured-output constraint"),
])
def test_tool_errors(client, body, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                       extra_body=body)
    assert info.value.status_code == 400
    assert info.value.body["message"] == message
    assert info.value.body["param"] == "tool_choice"


def test_hermes_calls_stream_as_written(servers):
    """``auto`` with the hermes parser, the output held to a call by a regex (a small model
    calls no tool on its own): the content before the call goes out as content, then,
    once the call closed and its arguments parse, the call's id and name, then its
    arguments as written, in one piece; whole and streamed agree."""
    s = servers["auto"].wait_until_healthy()
    regex = ('Let me check\\. <tool_call>\\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "[A-Z][a-z]{2,12}", "unit": "celsius"\\}\\}\\n</tool_call>')
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
                  extra_body={"guided_regex": regex})
    c = s.client(timeout=600)
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", "Let me check. ")
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith('{"city": "')  # as written
    content, calls, finish = streamed(c, **kwargs)
    assert (content, finish) == ("Let me check. ", ["tool_calls"])
    assert [(t["name"], t["arguments"]) for t in calls] == [
        ("get_weather", call.function.arguments)]
    assert calls[0]["pieces"] == 1


# two hermes calls, one after the other (a small model calls no tool on its own)
TWO_CALLS = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris", '
             '"unit": "celsius"\\}\\}\\n</tool_call>\\n<tool_call>\\n\\{"name": "get_time", '
             '"arguments": \\{"timezone": "CET"\\}\\}\\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_keeps_the_first_auto_call(servers, stream):
    """``parallel_tool_calls: false`` under ``auto`` keeps the first call only, whole and
    streamed (vLLM's ``maybe_filter_parallel_tool_calls``), where the output holds two."""
    c = servers["auto"].wait_until_healthy().client(timeout=600)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                  temperature=0, max_tokens=160, extra_body={"guided_regex": TWO_CALLS})
    first = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
    if stream:
        _, calls, finish = streamed(c, **kwargs)
        assert finish == ["tool_calls"]
        assert [(call["name"], call["arguments"]) for call in calls] == [first]
    else:
        choice = c.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments)
                for t in choice.message.tool_calls] == [first]


# one hermes call whose arguments are not JSON (an unquoted string): no call at all
BAD_CALL = ('Let me check\\. <tool_call>\\n\\{"name": "get_weather", "arguments": '
            '\\{"city": Paris\\}\\}\\n</tool_call>')


def test_a_hermes_call_with_invalid_json_streams_as_the_whole_answer(servers):
    """A call whose arguments are not JSON is no call: the whole answer is content with
    finish reason "stop", as vLLM's hermes parser reads it, and the stream's pieces add up
    to the same answer (no call with broken arguments, no content dropped)."""
    c = servers["auto"].wait_until_healthy().client(timeout=600)
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                  extra_body={"guided_regex": BAD_CALL})
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None
    assert whole.finish_reason == "stop"
    assert streamed(c, **kwargs) == (whole.message.content, [], [whole.finish_reason])


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
def test_a_forced_call_of_a_tool_whose_schema_uses_defs(client, tool_choice):
    """A pydantic-generated parameters schema (``$defs`` and ``#/$defs/...`` refs, as the
    openai SDK's ``pydantic_function_tool`` sends) is called under ``required`` or a named
    function: the ``$defs`` go to the root of the call schema, as vLLM's."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=DEFS_TOOL,
                                       tool_choice=tool_choice, temperature=0, max_tokens=100)
    calls = r.choices[0].message.tool_calls
    assert [t.function.name for t in calls] == ["locate"]
    jsonschema.validate(json.loads(calls[0].function.arguments), DEFS_PARAMS)


def test_auto_tool_choice_enabled(servers):
    """With ``--enable-auto-tool-choice --tool-call-parser hermes`` ``auto`` is accepted; a
    small model may or may not call a tool, so either answer must be well formed. (The
    module's last use of that server: it stops it and checks its exit.)"""
    s = servers["auto"].wait_until_healthy()
    try:
        c = s.client(timeout=600)
        choices = (openai.NOT_GIVEN, "auto")
        with ThreadPoolExecutor(4) as pool:  # all four greedy requests in one batch
            wholes = [pool.submit(c.chat.completions.create, model=MODEL, messages=ASK,
                                  tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                  max_tokens=60) for tool_choice in choices]
            streams = [pool.submit(streamed, c, model=MODEL, messages=ASK, tools=TOOLS,
                                   tool_choice=tool_choice, temperature=0, max_tokens=60)
                       for tool_choice in choices]
            results = [(w.result(), st.result()) for w, st in zip(wholes, streams, strict=True)]
        for r, (content, calls, finish) in results:
            choice = r.choices[0]
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls"
                for call in choice.message.tool_calls:
                    json.loads(call.function.arguments)
            else:
                assert choice.finish_reason in ("stop", "length")
                assert choice.message.content
            assert finish == [choice.finish_reason]
            assert (content or None) == choice.message.content
            assert [(t["name"], t["arguments"]) for t in calls] == [
                (t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()]
    finally:
        assert s.stop() == 0, s.output()


def test_auto_tool_choice_needs_parser(servers):
    with pytest.raises(RuntimeError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        servers["no-parser"].wait_until_healthy()

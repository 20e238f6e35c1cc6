"""Anthropic's Messages API (``/v1/messages``) through a real ``tpserve serve`` of SmolLM2
and the anthropic client: the answer equals the chat completion of the same conversation,
whole and streamed; stop sequences, a forced tool and its round trip; refusals."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # vLLM's sampling fields go in the body (the client has none)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You answer in one short sentence."
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TOOL = {"name": "get_weather", "description": "Current weather in a city",
        "input_schema": WEATHER}


@pytest.fixture(scope="module")
def server(small_server_8_seqs):
    return small_server_8_seqs.wait_until_healthy()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0,
                               timeout=600)


def chat(server, messages, **fields) -> dict:
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=600,
                   json={"model": MODEL, "messages": messages, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_answer_of_the_same_conversation(server, client):
    want = chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12)
    got = client.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12,
                                 extra_body=GREEDY)
    assert got.type == "message" and got.role == "assistant" and got.model == MODEL
    assert got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        want["choices"][0]["finish_reason"]]
    assert got.stop_sequence is None
    usage = want["usage"]
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert got.usage.output_tokens == usage["completion_tokens"]
    # system as text blocks, content as text blocks: the same prompt
    blocks = client.messages.create(
        model=MODEL, system=[{"type": "text", "text": SYSTEM}], max_tokens=12, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert blocks.content[0].text == got.content[0].text


def test_a_last_assistant_turn_is_continued(server, client):
    """Anthropic's prefill: the answer continues the assistant's text (not a new turn),
    as chat's ``continue_final_message`` does."""
    turns = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    got = client.messages.create(model=MODEL, messages=turns, max_tokens=8,
                                 extra_body=GREEDY)
    want = chat(server, turns, max_tokens=8, add_generation_prompt=False,
                continue_final_message=True)
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    new_turn = chat(server, turns, max_tokens=8)
    assert got.content[0].text != new_turn["choices"][0]["message"]["content"]


def test_the_stream_builds_the_same_message(client):
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=16,
                                extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text.split()[1]  # a word the greedy answer is about to write
    cut = client.messages.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=GREEDY,
                                 stop_sequences=["never-written", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(server, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = client.messages.create(model=MODEL, messages=ask, max_tokens=120, extra_body=GREEDY,
                                 tools=[TOOL], tool_choice={"type": "tool",
                                                            "name": "get_weather"})
    assert got.stop_reason == "tool_use"
    uses = [b for b in got.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in got.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "18 degrees, sunny"}]}]
    with client.messages.stream(model=MODEL, messages=ask, max_tokens=120, extra_body=GREEDY,
                                tools=[TOOL], tool_choice={"type": "tool",
                                                           "name": "get_weather"}) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert len(pieces) >= 8  # the input as the model wrote it
    assert json.loads("".join(pieces)) == uses[0].input
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
            for b in streamed.content] == [(b.type, getattr(b, "name", None),
                                            getattr(b, "input", None)) for b in got.content]
    answer = client.messages.create(model=MODEL, messages=history, max_tokens=12,
                                    extra_body=GREEDY, tools=[TOOL],
                                    tool_choice={"type": "none"})  # no parser: no auto
    # the same turn as chat completions: the call in the assistant message, the result
    # in a tool message
    call = {"id": uses[0].id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}
    text = "".join(b.text for b in got.content if b.type == "text")
    want = chat(server, [
        *ask, {"role": "assistant", "content": text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "18 degrees, sunny"}],
        max_tokens=12, tool_choice="none", tools=[{"type": "function", "function": {
            "name": "get_weather", "description": TOOL["description"],
            "parameters": WEATHER}}])
    assert answer.content[0].text == want["choices"][0]["message"]["content"]


def test_count_tokens_is_the_prompt_a_message_reads(server, client):
    """``POST /v1/messages/count_tokens`` (``client.messages.count_tokens``): the usage's
    input tokens (with those read from the prefix cache) of the same request."""
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    cases = [{"system": SYSTEM, "messages": ASK},
             {"messages": [*ASK, {"role": "assistant", "content": "The capital of France is"}]},
             {"messages": weather, "tools": [TOOL],
              "tool_choice": {"type": "tool", "name": "get_weather"}},
             {"messages": weather, "tools": [TOOL], "tool_choice": {"type": "none"}}]
    for fields in cases:
        counted = client.messages.count_tokens(model=MODEL, **fields).input_tokens
        got = client.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, **fields)
        assert counted == got.usage.input_tokens + got.usage.cache_read_input_tokens
    # the chat template's prompt, as /tokenize counts it
    r = httpx.post(f"{server.base}/tokenize", timeout=60, json={
        "model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, *ASK]})
    assert r.json()["count"] == client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=ASK).input_tokens
    # tools are counted with the tool choice left to the model (auto), which this server
    # could not answer (no tool-call parser): counting needs none
    with pytest.raises(anthropic.BadRequestError, match="auto"):
        client.messages.create(model=MODEL, max_tokens=1, messages=weather, tools=[TOOL])
    assert client.messages.count_tokens(model=MODEL, messages=weather, tools=[TOOL]
                                        ).input_tokens == client.messages.count_tokens(
        model=MODEL, messages=weather, tools=[TOOL], tool_choice={"type": "none"}).input_tokens


def test_an_output_format_is_followed(client):
    got = client.messages.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
        max_tokens=120, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(got.content[0].text), WEATHER)


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": ASK}, "max_tokens"),
    ({"messages": ASK, "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}], "max_tokens": 8},
     "image content blocks are not supported"),
    ({"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "extended thinking needs a server started with --reasoning-parser"),
    ({"messages": ASK, "max_tokens": 8, "thinking": {"type": "sometimes"}},
     "thinking.type must be enabled, adaptive or disabled"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 8},
     "role must be user or assistant"),
    ({"messages": ASK, "max_tokens": 8, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"messages": ASK, "max_tokens": 8, "tools": [{"type": "web_search_20250305",
                                                    "name": "web_search"}]},
     "only client tools"),
    ({"messages": ASK, "max_tokens": 8, "speed": "fast"}, "speed 'fast' is not supported"),
    ({"messages": ASK, "max_tokens": 8, "output_config": {"effort": "high"}},
     "output_config.effort is not supported"),
    ({"messages": ASK, "max_tokens": 8, "output_config": {"format": {"type": "xml"}}},
     "output_config.format must be"),
])
def test_what_cannot_be_honoured_is_a_400(server, body, message):
    r = httpx.post(f"{server.base}/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {  # Anthropic's envelope
        "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
    assert message in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match=message):
        anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0).post(
            "/v1/messages", body={"model": MODEL, **body}, cast_to=object)

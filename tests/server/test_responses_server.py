"""OpenAI's Responses API (``POST /v1/responses``) through the real openai client on the
embedded SmolLM2 (greedy by its defaults): each answer equals the chat completion of the
same conversation, streamed events add up to the whole response, tools and JSON schemas
work as on chat, and what the server cannot honour is refused naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.serverproc import ServerProcess

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "capital", "description": "The capital of a country",
        "parameters": SCHEMA}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--no-engine-process")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_text(client, messages, **kwargs) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                          **kwargs)


def test_a_response_is_the_chat_answer_of_its_input(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct",
                                input="What is the capital of France?", max_output_tokens=24)
    chat = chat_text(client, [{"role": "user", "content": "What is the capital of France?"}],
                     max_tokens=24)
    assert r.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.object == "response" and r.model == "SmolLM2-135M-Instruct"
    # instructions are the system message; a list input is the conversation
    r = client.responses.create(
        model="SmolLM2-135M-Instruct", instructions="Answer in French.", max_output_tokens=24,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]}])
    chat = chat_text(client, [{"role": "system", "content": "Answer in French."},
                              {"role": "user", "content": "Hello!"}], max_tokens=24)
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Answer in French."


def test_streamed_events_add_up_to_the_response(client):
    events = list(client.responses.create(
        model="SmolLM2-135M-Instruct", input="What is the capital of France?",
        max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "The capital of France is Paris."
    assert events[-4].text == text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens > 0
    # cut short by max_output_tokens: incomplete
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", stream=True,
                                          input="What is the capital of France?",
                                          max_output_tokens=3))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Capital of France?",
                                tools=[TOOL], tool_choice="required", max_output_tokens=64)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "capital"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    assert call.call_id.startswith("call_")
    streamed = list(client.responses.create(
        model="SmolLM2-135M-Instruct", input="Capital of France?", tools=[TOOL],
        tool_choice="required", max_output_tokens=64, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) >= 4 and "".join(pieces) == call.arguments  # as the model wrote them
    assert streamed[-1].response.output[0].arguments == call.arguments
    named = client.responses.create(model="SmolLM2-135M-Instruct", input="Capital of France?",
                                    tools=[TOOL], max_output_tokens=64,
                                    tool_choice={"type": "function", "name": "capital"})
    assert [(c.type, c.name) for c in named.output] == [("function_call", "capital")]
    jsonschema.validate(json.loads(named.output[0].arguments), SCHEMA)
    # the call and its output go back as input: the same prompt as chat's tool messages
    history = [{"type": "message", "role": "user", "content": "Capital of France?"},
               {"type": "function_call", "call_id": call.call_id, "name": "capital",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Paris"}]
    r = client.responses.create(model="SmolLM2-135M-Instruct", input=history, tools=[TOOL],
                                tool_choice="none", max_output_tokens=16)
    chat = chat_text(client, [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "capital", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Paris"}],
        tools=[{"type": "function", "function": {"name": "capital",
                                                 "description": TOOL["description"],
                                                 "parameters": SCHEMA}}],
        tool_choice="none", max_tokens=16)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_input_tokens_counts_the_prompt_a_response_reads(client):
    """``POST /v1/responses/input_tokens`` (``client.responses.input_tokens.count``): the
    usage's input tokens of the same request, tools and instructions included."""
    cases = [{"input": "What is the capital of France?"},
             {"instructions": "Answer in French.",
              "input": [{"role": "user", "content": [{"type": "input_text",
                                                      "text": "Hello!"}]}]},
             {"input": "Capital of France?", "tools": [TOOL], "tool_choice": "required"}]
    for fields in cases:
        counted = client.responses.input_tokens.count(model="SmolLM2-135M-Instruct", **fields)
        assert counted.object == "response.input_tokens"
        r = client.responses.create(model="SmolLM2-135M-Instruct", max_output_tokens=2,
                                    **fields)
        assert counted.input_tokens == r.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:  # errors name the Responses field
        client.responses.input_tokens.count(model="SmolLM2-135M-Instruct", input=[])
    assert info.value.body["param"] == "input"


def test_a_json_schema_format_constrains_the_text(client):
    r = client.responses.create(
        model="SmolLM2-135M-Instruct", input="Where is the Eiffel Tower?", max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # SmolLM2's template lacks it
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),  # as chat's verbosity
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 500}, "temperature"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(client, fields, param):
    body = {"model": "SmolLM2-135M-Instruct", "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_vllm_sampling_fields_pass_through(client):
    """``top_k``, ``ignore_eos`` and friends apply as on chat; an unknown field is
    ignored."""
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Hi",
                                max_output_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True, "top_k": 1,
                                            "no_such_field": 1})
    assert r.usage.output_tokens == 12 and r.status == "incomplete"

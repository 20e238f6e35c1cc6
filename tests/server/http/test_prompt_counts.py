"""Token counting without generating: ``/v1/messages/count_tokens`` (Anthropic's) and
``/v1/responses/input_tokens`` (OpenAI's) count exactly the prompt the engine is handed for
the same request, tools included. The app on a real uvicorn server over the fake engine,
with a chat template that shows the tools (SmolLM2's own leaves them out), driven by the
real anthropic and openai clients."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app

MODEL = "smol"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=512)


@pytest.fixture(scope="module")
def base_url(engine) -> Iterator[str]:
    with running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                           chat_template=TEMPLATE)) as url:
        yield url


@pytest.fixture(autouse=True)
def _reset(engine) -> None:
    engine.reset()


def handed_over(engine: FakeEngine) -> int:
    """The length of the one prompt the engine was handed since the last reset."""
    (prompt,) = engine.prompts.values()
    engine.reset()
    return len(prompt)


def test_messages_count_tokens_is_the_prompt_the_engine_gets(base_url, engine):
    client = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=20)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}
    cases = [{"messages": ASK},
             {"system": "Be brief.", "messages": ASK},
             {"messages": [*ASK, {"role": "assistant", "content": "It is"}]},  # a prefill
             {"messages": ASK, "tools": [tool], "tool_choice": {"type": "any"}},
             {"messages": ASK, "tools": [tool], "tool_choice": {"type": "none"}}]
    counts = []
    for fields in cases:
        counted = client.messages.count_tokens(model=MODEL, **fields).input_tokens
        assert engine.prompts == {}  # counting runs nothing
        client.messages.create(model=MODEL, max_tokens=2, **fields)
        assert counted == handed_over(engine), fields
        counts.append(counted)
    assert counts[3] == counts[4] > counts[0]  # the tools are in the prompt
    # the model's choice (auto) needs a tool-call parser to be answered, not to be counted
    assert client.messages.count_tokens(model=MODEL, messages=ASK,
                                        tools=[tool]).input_tokens == counts[3]
    with pytest.raises(anthropic.BadRequestError, match="tool-call-parser"):
        client.messages.create(model=MODEL, max_tokens=2, messages=ASK, tools=[tool])


def test_responses_input_tokens_is_the_prompt_the_engine_gets(base_url, engine):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                           timeout=20)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    cases = [{"input": "What is the weather in Paris?"},
             {"instructions": "Be brief.", "input": ASK},
             {"input": ASK, "tools": [tool], "tool_choice": "required"}]
    counts = []
    for fields in cases:
        counted = client.responses.input_tokens.count(model=MODEL, **fields)
        assert counted.object == "response.input_tokens" and engine.prompts == {}
        client.responses.create(model=MODEL, max_output_tokens=2, **fields)
        assert counted.input_tokens == handed_over(engine), fields
        counts.append(counted.input_tokens)
    assert counts[2] > counts[0]
    with pytest.raises(openai.NotFoundError, match="gpt-x"):
        client.responses.input_tokens.count(model="gpt-x", input="hi")

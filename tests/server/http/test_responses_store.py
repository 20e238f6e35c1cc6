"""Stored responses (``--responses-store-size``, ``http/responses/store.py``) on a real
uvicorn server over the fake engine, driven by the openai client: a conversation continued
by ``previous_response_id`` (whole and streamed answers, function calls and their outputs),
retrieval, input items, deletion, the store's bound, and the 400 / 404 answers."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.http.fake_engine import TEXT, FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.responses.store import ResponseStore

MODEL = "smol"
# every message as [role:content], and a call as [call:name(arguments)]
SHOWS = ("{% for m in messages %}[{{ m.role }}:{{ m.content }}"
         "{% for c in m.tool_calls or [] %}(call:{{ c.function.name }}"
         "{{ c.function.arguments }}){% endfor %}]{% endfor %}")
ANSWER = TEXT[:TEXT.index(" fox")]  # the fake engine's first 3 tokens: " The quick brown"


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=512)


def serve(engine, size: int = 8):
    return running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                             chat_template=SHOWS,
                             frontend=FrontendOptions(responses_store_size=size)))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)


def prompt(engine) -> str:
    """The text of the last prompt the engine was handed."""
    return engine.tokenizer.decode(engine.prompts[engine.started[-1]])


def test_a_conversation_continues_from_the_stored_response(engine):
    with serve(engine) as url:
        c = client(url)
        first = c.responses.create(model=MODEL, input="Hi!", instructions="Be brief.",
                                   max_output_tokens=3)
        assert first.store is True and first.output_text == ANSWER
        assert prompt(engine) == "[system:Be brief.][user:Hi!]"
        second = c.responses.create(model=MODEL, input="And then?", max_output_tokens=3,
                                    previous_response_id=first.id)
        assert second.previous_response_id == first.id
        # the instructions are not carried over, as in OpenAI's API
        assert prompt(engine) == f"[user:Hi!][assistant:{ANSWER}][user:And then?]"
        events = list(c.responses.create(model=MODEL, max_output_tokens=3, stream=True,
                                         previous_response_id=second.id,
                                         input=[{"role": "user", "content": "Last one."}]))
        assert events[-1].type == "response.incomplete"  # max_output_tokens: kept anyway
        third = events[-1].response
        assert prompt(engine) == (f"[user:Hi!][assistant:{ANSWER}][user:And then?]"
                                  f"[assistant:{ANSWER}][user:Last one.]")
        # a call and its output, given as input, are in the conversation too
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
        c.responses.create(model=MODEL, max_output_tokens=3, previous_response_id=third.id,
                           input=[call, {"type": "function_call_output", "call_id": "c1",
                                         "output": "42"}])
        assert prompt(engine).endswith(f"[assistant:{ANSWER}][assistant:(call:f{{}})]"
                                       "[tool:42]")
        got = c.responses.retrieve(third.id)
        assert got.model_dump() == third.model_dump()


def test_input_items_and_deletion(engine):
    with serve(engine) as url:
        c = client(url)
        first = c.responses.create(model=MODEL, input="One", max_output_tokens=2)
        second = c.responses.create(model=MODEL, input=[{"role": "user", "content": "Two",
                                                         "id": "msg_two"}],
                                    max_output_tokens=2, previous_response_id=first.id)
        page = c.responses.input_items.list(second.id, order="asc")
        kinds = [(item.type, getattr(item, "role", None)) for item in page.data]
        assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
        assert page.data[-1].id == "msg_two" and page.data[1].id == first.output[0].id
        newest = c.responses.input_items.list(second.id, limit=1)  # desc by default
        assert [i.id for i in newest.data] == ["msg_two"] and newest.has_more
        older = c.responses.input_items.list(second.id, limit=5, after="msg_two")
        assert [i.id for i in older.data] == [i.id for i in page.data[:2]][::-1]
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        assert err.value.body["param"] == "previous_response_id"
        assert c.responses.retrieve(second.id).id == second.id  # its own conversation kept
        # OpenAI's input message items: content parts and a status, whatever the input
        item = page.data[0]  # first's input, given as a string
        assert item.status == "completed"
        assert [(p.type, p.text) for p in item.content] == [("input_text", "One")]


def test_input_tokens_count_the_previous_conversation(engine):
    """``/v1/responses/input_tokens`` reads what the same ``/v1/responses`` request
    reads, the conversation ``previous_response_id`` continues included; an id the store
    does not hold is a 404 there too."""
    with serve(engine) as url:
        c = client(url)
        first = c.responses.create(model=MODEL, input="Hi!", max_output_tokens=3)
        assert first.id.startswith("resp_")  # OpenAI's (and vLLM's) id form
        fields = {"input": "And then?", "previous_response_id": first.id}
        counted = c.responses.input_tokens.count(model=MODEL, **fields)
        follow = c.responses.create(model=MODEL, max_output_tokens=2, **fields)
        assert counted.input_tokens == follow.usage.input_tokens
        assert counted.input_tokens > c.responses.input_tokens.count(
            model=MODEL, input="And then?").input_tokens
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.input_tokens.count(model=MODEL, input="x",
                                           previous_response_id="resp_none")
        assert err.value.body["param"] == "previous_response_id"


def test_store_false_and_a_server_that_keeps_none(engine):
    with serve(engine) as url:
        c = client(url)
        unkept = c.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(unkept.id)
    with serve(engine, size=0) as url:
        c = client(url)
        r = c.responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert r.store is False
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=MODEL, input="x", previous_response_id=r.id)
        assert err.value.body["param"] == "previous_response_id"
        assert "--responses-store-size" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)


def test_the_store_keeps_the_last_ones_used():
    store = ResponseStore(2)
    for k in range(3):
        store.put({"id": f"r{k}", "output": [{"type": "message", "k": k}]},
                  [{"type": "message", "role": "user", "content": str(k)}])
        if k == 1:
            store.get("r0")  # read: the least recently used is now r1
    assert len(store) == 2 and store.get("r0").outputs == ({"type": "message", "k": 0},)
    with pytest.raises(Exception, match="'r1' not found"):
        store.get("r1")
    assert json.loads(json.dumps(store.get("r2").conversation))[0]["content"] == "2"
    with pytest.raises(ValueError, match="at least 1"):
        ResponseStore(0)
    with pytest.raises(ValueError, match="--responses-store-size must be >= 0"):
        FrontendOptions(responses_store_size=-1)


def test_a_response_echoes_the_temperature_and_top_p_it_used(engine):
    """As OpenAI's and vLLM's response objects: the request's values, else the server's
    defaults (``--generation-config``), else 1.0; never null."""
    with running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                           chat_template=SHOWS,
                           default_sampling_params={"temperature": 0.6, "top_p": 0.9})) as url:
        c = client(url)
        r = c.responses.create(model=MODEL, input="Hi!", max_output_tokens=3)
        assert (r.temperature, r.top_p) == (0.6, 0.9)
        events = list(c.responses.create(model=MODEL, input="Hi!", max_output_tokens=3,
                                         temperature=0.2, stream=True))
        assert [(e.response.temperature, e.response.top_p) for e in (events[0], events[-1])
                ] == [(0.2, 0.9), (0.2, 0.9)]
    with serve(engine) as url:
        r = client(url).responses.create(model=MODEL, input="Hi!", max_output_tokens=3,
                                         top_p=0.5)
        assert (r.temperature, r.top_p) == (1.0, 0.5)

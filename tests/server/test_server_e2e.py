"""The real openai client against a real ``tpserve serve`` of the embedded SmolLM2."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess

KEY = "test-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*SMALL, "--api-key", KEY, "--served-model-name", "smol",
                      "--no-engine-process")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def server_engine_process():
    s = ServerProcess(*SMALL, "--api-key", KEY, "--served-model-name", "smol",
                      "--engine-process")
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module", params=["server", "server_engine_process"],
                ids=["in-process", "engine-process"])
def any_server(request):
    """The server with the engine in process, then in its own process."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def any_client(any_server):
    return openai.OpenAI(base_url=any_server.base + "/v1", api_key=KEY, max_retries=0)


def test_completion_greedy(any_server, any_client):
    r = any_client.completions.create(model="smol", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
    assert r.choices[0].text.startswith(" Paris.")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 8)
    assert r.usage.total_tokens == 13
    # the engine's stats are current once the answer is back (the engine process sends
    # them with the output that leaves it idle)
    assert any_server.metric("num_requests_running") == 0
    assert any_server.metric("kv_cache_usage_perc") == 0
    assert any_server.metric("generation_tokens_total") >= 8


def test_chat_and_streaming_equal_non_streaming(any_client):
    client = any_client
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="smol", messages=msgs, max_tokens=24,
                                          temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and len(text) > 5
    chunks = list(client.chat.completions.create(
        model="smol", messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].choices == []

    stream = client.completions.create(model="smol", prompt=PROMPT, max_tokens=10,
                                       temperature=0, stream=True)
    once = client.completions.create(model="smol", prompt=PROMPT, max_tokens=10, temperature=0)
    assert "".join(c.choices[0].text for c in stream) == once.choices[0].text


def test_stop_strings_and_stop_reason(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=20, temperature=0,
                                  stop=["."])
    assert r.choices[0].text == " Paris"
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "."


def test_min_tokens_hold_back_stop_strings(client):
    """vLLM's rule: a stop string counts only where it ends past the first ``min_tokens``
    tokens' text; streamed the same."""
    # greedy: " Paris" "." "\n\n" "The" " answer" " is" ":" ...; "." is token 2
    kw = dict(model="smol", prompt=PROMPT, max_tokens=24, temperature=0, stop=[".", ":"],
              extra_body={"min_tokens": 5})
    r = client.completions.create(**kw)
    assert r.choices[0].text == " Paris.\n\nThe answer is"
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]) == ("stop", ":")
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("stop, include", [([" capital of", " is the"], False),
                                           ("s.\n\nThe cap", False), ("ris.", True)])
def test_streamed_text_offsets_are_the_whole_answers(client, stop, include):
    """A stream's completions ``text_offset``s are the tokens' own, as the whole answer's,
    also while text that may begin a stop string is held back (they once counted the
    text emitted so far: [0, 5, 5, 5, 5, 5, 19] for [0, 6, 7, 8, 9, 12, 19])."""
    kw = dict(model="smol", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
              logprobs=1, extra_body={"include_stop_str_in_output": include})
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets = [], []
    for c in client.completions.create(**kw, stream=True):
        for choice in c.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    assert (tokens, offsets) == (whole.tokens, whole.text_offset)
    assert len(set(offsets)) == len(offsets)


def test_a_stop_token_or_eos_adds_no_text_unless_include_stop_str_in_output(server, client):
    """As vLLM: the token that stop-terminates the output (a stop token id, or EOS read
    with ``skip_special_tokens`` false) stays out of the text, its id in the output."""
    dot = httpx.post(server.base + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": ".", "add_special_tokens": False},
                     timeout=60).json()["tokens"][0]
    kw = dict(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    for include, text in ((False, " Paris"), (True, " Paris.")):
        c = client.completions.create(**kw, extra_body={
            "stop_token_ids": [dot], "include_stop_str_in_output": include,
            "return_token_ids": True}).choices[0]
        assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (text, "stop", dot)
        assert c.model_extra["token_ids"][-1] == dot
    messages = [{"role": "user", "content": "Say hi"}]
    for include in (False, True):
        c = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=60, temperature=0,
            extra_body={"skip_special_tokens": False,
                        "include_stop_str_in_output": include}).choices[0]
        assert c.finish_reason == "stop"  # the model's EOS
        assert c.message.content.endswith("<|im_end|>") == include, c.message.content


def test_n_and_seed_reproducibility(client):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=16, temperature=1.0,
              top_p=0.95)
    a = client.completions.create(n=3, seed=7, **kw)
    b = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # siblings sample differently
    assert a.usage.completion_tokens == b.usage.completion_tokens <= 3 * 16
    assert a.usage.prompt_tokens == 4


def test_logprobs(client):
    r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert val <= 0 and max(top.values()) == pytest.approx(val, abs=1e-5)  # greedy
        assert tok in top
    c = openai.OpenAI(base_url=client.base_url, api_key=KEY).chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_error_codes(server, client):
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0
                      ).models.list()
    assert e.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["type"] == "NotFoundError" or "gpt-4" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=4000)
    msg = str(e.value)
    assert "2048" in msg and "5" in msg and "4000" in msg
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt=PROMPT, temperature=-1)
    r = httpx.post(server.base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "smol", "prompt": PROMPT, "max_tokens": "many"})
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param",
                                                                "code"}
    assert httpx.get(server.base + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_tokenize_detokenize_version_metrics(server):
    h = {"Authorization": f"Bearer {KEY}"}
    t = httpx.post(server.base + "/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert t["tokens"] == [504, 3575, 282, 4649, 314] and t["count"] == 5
    d = httpx.post(server.base + "/detokenize", json={"tokens": t["tokens"]}, headers=h).json()
    assert d["prompt"] == PROMPT
    assert httpx.get(server.base + "/version").status_code == 200
    assert server.metric("kv_blocks_total") > 0
    assert server.metric("generation_tokens_total") > 0
    # where the engine loop's time went: its own host work and waits for the device
    assert server.metric("steps_total") > 0
    assert server.metric("step_host_seconds_total") > 0
    assert server.metric("device_wait_seconds_total") == 0  # on CPU the host does it all

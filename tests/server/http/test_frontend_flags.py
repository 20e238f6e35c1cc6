"""vLLM's frontend flags (``http/frontend.FrontendOptions``) on the app, on a real uvicorn
server over the fake engine, driven by the openai client: ``--default-chat-template-
kwargs``, ``--chat-template-content-format``, ``--enable-force-include-usage``,
``--return-tokens-as-token-ids``, ``--exclude-tools-when-tool-choice-none``,
``--enable-request-id-headers``, and ``GET /load``. ``tests/server/test_vllm_server_flags_
server.py`` starts a real ``tpserve serve`` with them."""

from __future__ import annotations

import pickle
import threading

import httpx
import openai
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.reasoning_effort import template_source

MODEL = "smol"
MESSAGES = [{"role": "user", "content": "Hi!"}]
SHOWS = ("{{ greeting }}|{% for m in messages %}{{ m.content }}{% endfor %}|"
         "{{ tools | length if tools else 'no tools' }}")
PARTS = "{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]" \
        "{% endfor %}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


def serve(engine, **options):
    options.setdefault("trust_request_chat_template", True)  # the tests' own templates
    return running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                             chat_template=SHOWS, frontend=FrontendOptions(**options)))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)


def prompt_text(c: openai.OpenAI, **extra) -> str:
    r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                  extra_body={"return_prompt_text": True, **extra})
    return r.model_extra["prompt_text"]


def test_default_chat_template_kwargs_under_the_requests(engine):
    with serve(engine, default_chat_template_kwargs={"greeting": "hello"}) as url:
        c = client(url)
        assert prompt_text(c) == "hello|Hi!|no tools"
        assert prompt_text(c, chat_template_kwargs={"greeting": "bye"}) == "bye|Hi!|no tools"
        counted = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["count"]
        assert counted == len(engine.tokenizer.encode("hello|Hi!|no tools",
                                                      add_special_tokens=False))
    with serve(engine) as url:
        assert prompt_text(client(url)) == "|Hi!|no tools"


def test_the_defaults_are_checked(engine):
    with pytest.raises(ValueError, match="cannot set tools"):
        FrontendOptions(default_chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="content-format must be one of"):
        FrontendOptions(chat_template_content_format="xml")
    given = {"a": [1]}
    frozen = FrontendOptions(default_chat_template_kwargs=given)
    given["b"] = 2  # a copy is kept, and each reader gets its own
    assert frozen.template_kwargs == {"a": [1]}
    assert pickle.loads(pickle.dumps(frozen)) == frozen  # it travels to the engine process


def test_reasoning_effort_over_the_servers_defaults(engine):
    """A request's reasoning_effort sets enable_thinking over the server's default for it;
    the request's own chat_template_kwargs win over both."""
    reads = "thinking={{ enable_thinking }}"
    with serve(engine, default_chat_template_kwargs={"enable_thinking": False}) as url:
        c = client(url)
        assert prompt_text(c, chat_template=reads) == "thinking=False"
        assert prompt_text(c, chat_template=reads, reasoning_effort="high") == "thinking=True"
        assert prompt_text(c, chat_template=reads, reasoning_effort="high",
                           chat_template_kwargs={"enable_thinking": False}) == "thinking=False"


def test_the_template_read_is_the_one_rendered():
    named = {"default": "{{ messages }}", "tool_use": "{{ reasoning_effort }}"}
    assert template_source(None, named, tools=True) == "{{ reasoning_effort }}"
    assert template_source(None, named, tools=False) == "{{ messages }}"
    assert template_source("tool_use", named, tools=False) == "{{ reasoning_effort }}"
    assert template_source("{{ x }}", named, tools=False) == "{{ x }}"
    assert template_source(None, "{{ y }}", tools=False) == "{{ y }}"


def test_content_as_openai_parts(engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    with serve(engine, chat_template_content_format="openai") as url:
        c = client(url)
        assert prompt_text(c, chat_template=PARTS) == "[text:Hi!]"
        r = c.chat.completions.create(model=MODEL, messages=parts, max_tokens=1, extra_body={
            "return_prompt_text": True, "chat_template": PARTS})
        assert r.model_extra["prompt_text"] == "[text:a][text:b]"
    with serve(engine) as url:  # auto: the template loops over the content, as vLLM reads it
        assert prompt_text(client(url), chat_template=PARTS) == "[text:Hi!]"
        assert prompt_text(client(url)) == "|Hi!|no tools"  # SHOWS prints a string
    with serve(engine, chat_template_content_format="string") as url:
        # a string: the same loop walks its characters
        assert prompt_text(client(url), chat_template=PARTS) == "[:][:][:]"


def test_force_include_usage(engine):
    with serve(engine, force_include_usage=True) as url:
        chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                          max_tokens=3, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        chunks = list(client(url).completions.create(model=MODEL, prompt="x", max_tokens=3,
                                                     stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        chunks = list(client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
            stream_options={"continuous_usage_stats": True}))  # without include_usage
        assert all(ch.usage is not None for ch in chunks)
        assert [ch.usage.completion_tokens for ch in chunks][-2:] == [3, 3]
    with serve(engine) as url:
        chunks = list(client(url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                          max_tokens=3, stream=True))
        assert all(ch.usage is None for ch in chunks)


def test_return_tokens_as_token_ids_by_default(engine):
    with serve(engine, return_tokens_as_token_ids=True) as url:
        c = client(url)
        r = c.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=1)
        assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
        r = c.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=1,
                                 extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
        chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                         logprobs=True)
        assert all(t.token.startswith("token_id:") for t in chat.choices[0].logprobs.content)
    with serve(engine) as url:
        r = client(url).completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=1)
        assert not any(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)


def test_tools_hidden_when_tool_choice_is_none(engine):
    for hide, shown in ((True, "no tools"), (False, "1")):
        with serve(engine, exclude_tools_when_tool_choice_none=hide) as url:
            c = client(url)
            assert prompt_text(c, tools=TOOLS, tool_choice="none") == f"|Hi!|{shown}"
            counted = httpx.post(f"{url}/v1/responses/input_tokens", json={
                "model": MODEL, "input": "Hi!", "tool_choice": "none", "tools": [
                    {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
            assert counted.json()["input_tokens"] == len(engine.tokenizer.encode(
                f"|Hi!|{shown}", add_special_tokens=False))
            r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          tools=TOOLS, tool_choice="required",
                                          extra_body={"return_prompt_text": True})
            assert r.model_extra["prompt_text"] == "|Hi!|1"  # other choices show them


def test_request_id_headers(engine):
    with serve(engine, request_id_headers=True) as url, httpx.Client(base_url=url) as http:
        sent = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                         headers={"X-Request-Id": "abc-123"})
        assert sent.headers["x-request-id"] == "abc-123"
        made = http.get("/v1/models")
        assert len(made.headers["x-request-id"]) == 32
        assert http.get("/v1/models").headers["x-request-id"] != made.headers["x-request-id"]
        err = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"},
                        headers={"X-Request-Id": "bad-1"})
        assert err.status_code == 400 and err.headers["x-request-id"] == "bad-1"
        with http.stream("POST", "/v1/completions", json={
                "prompt": "x", "max_tokens": 2, "stream": True},
                headers={"X-Request-Id": "s-1"}) as stream:
            assert stream.headers["x-request-id"] == "s-1"
    with serve(engine) as url:
        assert "x-request-id" not in httpx.get(f"{url}/v1/models").headers


def test_load_counts_the_requests_in_flight(engine):
    with serve(engine) as url, httpx.Client(base_url=url, timeout=20) as http:
        assert http.get("/load").json() == {"server_load": 0}
        engine.step_delay = 0.05
        inside = [threading.Event(), threading.Event()]
        seen = []

        def stream(k: int) -> None:
            with http.stream("POST", "/v1/completions", json={
                    "prompt": "x", "max_tokens": 40, "stream": True}) as r:
                for _ in r.iter_lines():
                    inside[k].set()

        try:
            threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
            for t in threads:
                t.start()
            assert all(e.wait(10) for e in inside)  # both streams are being answered
            seen.append(http.get("/load").json()["server_load"])
            for t in threads:
                t.join(20)
        finally:
            engine.step_delay = 0.0
        assert seen == [2] and http.get("/load").json() == {"server_load": 0}
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert http.get("/load").json() == {"server_load": 0}

"""A real ``tpserve serve`` of SmolLM2 with ``--chat-template``: the template replaces the
model's (developer messages render as system ones), several completion prompts answer as
their single-prompt requests do, and ``logit_bias`` moves greedy decoding."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess(*SMALL, "--chat-template", str(path))
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def rendered(server, messages) -> str:
    r = httpx.post(server.base + "/tokenize", json={"messages": messages}, timeout=60)
    ids = r.json()["tokens"]
    return httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=60).json()[
        "prompt"]


def test_chat_template_replaces_the_models(server, client):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi!"}]
    assert rendered(server, messages) == "[system] Be brief.\n[user] Hi!\n[assistant] "
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       temperature=0)
    expected = len(httpx.post(server.base + "/tokenize", json={"messages": messages},
                              timeout=60).json()["tokens"])
    assert r.usage.prompt_tokens == expected


def test_several_prompts_equal_single_requests(client):
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
              for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.choices[0].text for s in single for _ in (0, 1)]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in single)


def test_logit_bias(server, client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      logprobs=0)
    first = plain.choices[0].text
    first_id = httpx.post(server.base + "/tokenize",
                          json={"prompt": first, "add_special_tokens": False},
                          timeout=60).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                       temperature=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].text != first
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                       temperature=0, logit_bias={"1234": 100})
    text = httpx.post(server.base + "/detokenize", json={"tokens": [1234] * 3},
                      timeout=60).json()["prompt"]
    assert forced.choices[0].text == text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  logit_bias={"49152": 1})
    assert info.value.body["param"] == "logit_bias"

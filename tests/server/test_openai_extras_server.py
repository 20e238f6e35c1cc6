"""A real ``tpserve serve`` of SmolLM2 with ``--chat-template``: the template replaces the
model's (developer messages render as system ones), several completion prompts answer as
their single-prompt requests do, and ``logit_bias`` moves greedy decoding."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.serverproc import SMALL, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = ("{% if note %}(note: {{ note }})\n{% endif %}"
            "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess(*SMALL, "--chat-template", str(path), "--trust-request-chat-template")
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
                                       temperature=0, logit_bias={"1234": 100}, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    text = httpx.post(server.base + "/detokenize", json={"tokens": [1234] * 3},
                      timeout=60).json()["prompt"]
    assert forced.choices[0].text == text
    # the default --logprobs-mode, raw_logprobs: the model's own distribution, bias unseen
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                            "logprob_token_ids": [1234]})
    top = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    got = forced.choices[0].logprobs
    assert got.token_logprobs[0] == raw.choices[0].logprobs.top_logprobs[0]["token_id:1234"]
    assert got.token_logprobs[0] < -1.0  # not the biased ~0
    assert {k: v for k, v in got.top_logprobs[0].items() if k != "token_id:1234"} == (
        top.choices[0].logprobs.top_logprobs[0])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  logit_bias={"49152": 1})
    assert info.value.body["param"] == "logit_bias"


# ------------------------------------------------------------------ echo (prompt logprobs)
ECHO_PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


def test_echo_scores_the_prompt_as_generation_scores_its_next_token(server, client):
    """``echo`` + ``logprobs`` + ``max_tokens: 0`` (lm-eval's loglikelihood request): the
    prompt comes back as the text with one entry per prompt token, the first unscored; each
    later entry equals what a generation request over the tokens before it reports for
    that token among its top 5."""
    ids = httpx.post(server.base + "/tokenize", json={"prompt": ECHO_PROMPT},
                     timeout=60).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=5,
                                  max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == ECHO_PROMPT and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    checked = 0
    for i in range(1, len(ids)):
        gen = client.completions.create(model=MODEL, prompt=ids[:i], max_tokens=1,
                                        logprobs=5, temperature=0).choices[0].logprobs
        top = gen.top_logprobs[0]
        # legacy top_logprobs hold the scored token itself beside the top 5
        assert set(lp.top_logprobs[i]) == set(top) | {lp.tokens[i]}, i
        if lp.tokens[i] in top:
            assert abs(top[lp.tokens[i]] - lp.token_logprobs[i]) < 1e-3, i
            checked += 1
    assert checked >= len(ids) // 2  # a trained model ranks most of its text's tokens high


def test_echo_then_generation(client):
    plain = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=4,
                                      logprobs=1, temperature=0, n=1).choices[0]
    r = client.completions.create(model=MODEL, prompt=[ECHO_PROMPT, "1, 2, 3,"], echo=True,
                                  logprobs=1, max_tokens=4, temperature=0, n=2)
    assert len(r.choices) == 4
    assert [c.text for c in r.choices[:2]] == [ECHO_PROMPT + plain.text] * 2
    assert all(c.text.startswith("1, 2, 3,") for c in r.choices[2:])
    lp = r.choices[0].logprobs
    assert lp.tokens[-4:] == plain.logprobs.tokens
    assert lp.token_logprobs[-4:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset[-4] == len(ECHO_PROMPT)
    # without logprobs only the text is echoed
    bare = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True,
                                     max_tokens=4, temperature=0).choices[0]
    assert bare.text == ECHO_PROMPT + plain.text and bare.logprobs is None


def test_echo_streams_the_prompt_first(client):
    whole = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=1,
                                      max_tokens=3, temperature=0).choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True,
                                            logprobs=1, max_tokens=3, temperature=0,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text == ECHO_PROMPT
    assert first.logprobs.tokens == whole.logprobs.tokens[:len(first.logprobs.tokens)]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.text
    only = list(client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True,
                                          max_tokens=0, stream=True))
    assert "".join(ch.choices[0].text for ch in only if ch.choices) == ECHO_PROMPT


def test_vllm_prompt_logprobs(client):
    """vLLM's ``prompt_logprobs`` extension: per prompt token (the first null) a dict by
    token id holding the token (its logprob as ``echo`` scores it, its rank) and the top
    alternatives ranked 1..k; chat answers it once, at the top level."""
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, echo=True, logprobs=1,
                                  max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    c = r.choices[0]
    pl = c.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(c.logprobs.tokens) - 1 == r.usage.prompt_tokens
    assert len(c.logprobs.top_logprobs[1]) <= 2  # echo keeps its own logprobs=1
    for i, entry in enumerate(pl[1:], start=1):
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        top = [e for e in ranked if e["rank"] <= 3]
        assert [e["rank"] for e in top[:3]] == [1, 2, 3], i
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)
        own = next(e for e in entry.values() if e["decoded_token"] == c.logprobs.tokens[i])
        assert own["logprob"] == pytest.approx(c.logprobs.token_logprobs[i], abs=1e-6)
        assert own["rank"] >= 1 and (own["rank"] > 3) == (len(entry) == 4), i
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 0})
    cpl = chat.model_extra["prompt_logprobs"]
    assert cpl[0] is None and len(cpl) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in cpl[1:])


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_stats(client, kind):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so
    far (the prompt's tokens, the completion tokens read back until then), ending at the
    final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=12, temperature=0, stream=True, stream_options=options))
    else:
        chunks = list(client.completions.create(
            model=MODEL, prompt="1, 2, 3,", max_tokens=12, temperature=0, stream=True,
            stream_options=options))
    assert all(c.usage is not None for c in chunks)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] < 12
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    plain = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3,
                                           stream=True, stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_chat_template_fields(server, client):
    """vLLM's ``chat_template_kwargs`` reach the template; ``continue_final_message`` leaves
    the last (assistant) message open and the model continues it; each is the prompt
    /tokenize renders with the same fields."""
    def tokenize(**fields):
        return httpx.post(server.base + "/tokenize", json=fields, timeout=60).json()

    msgs = [{"role": "user", "content": "Hi!"}]
    ids = tokenize(messages=msgs, chat_template_kwargs={"note": "be kind"})["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert text["prompt"] == "(note: be kind)\n[user] Hi!\n[assistant] "
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"note": "be kind"}})
    assert r.usage.prompt_tokens == len(ids)
    open_msgs = msgs + [{"role": "assistant", "content": "The capital of France is"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = tokenize(messages=open_msgs, **fields)["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert text["prompt"].endswith("[assistant] The capital of France is")
    r = client.chat.completions.create(model=MODEL, messages=open_msgs, max_tokens=4,
                                       temperature=0, extra_body=fields)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=open_msgs, max_tokens=2,
                                           extra_body=extra)
        assert e.value.body["param"] == param


def test_truncate_prompt_tokens_and_tokens_as_ids(server, client):
    """vLLM's ``truncate_prompt_tokens`` serves the prompt's last k tokens (as if only they
    were sent); ``return_tokens_as_token_ids`` names logprob tokens ``token_id:<id>``."""
    ids = httpx.post(server.base + "/tokenize", json={"prompt": ECHO_PROMPT},
                     timeout=60).json()["tokens"]
    cut = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=4,
                                    temperature=0, extra_body={"truncate_prompt_tokens": 5})
    tail = client.completions.create(model=MODEL, prompt=ids[-5:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "Hi!"}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    r = client.completions.create(model=MODEL, prompt=ids[:6], max_tokens=3, temperature=0,
                                  logprobs=2, echo=True,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens[:6] == [f"token_id:{i}" for i in ids[:6]]
    assert all(t.startswith("token_id:") for t in lp.tokens[6:]) and len(lp.tokens) == 9
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, logprobs=True, top_logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert all(t.token.startswith("token_id:") for t in c.choices[0].logprobs.content)


def test_request_chat_template_documents_and_chat_echo(server, client):
    """A request's own ``chat_template`` (with ``documents``) replaces the server's for that
    request; chat ``echo`` starts the answer with the open assistant message, streamed or
    not."""
    template = ("{% for d in documents %}[doc {{ d.title }}] {{ d.text }}\n{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    msgs = [{"role": "user", "content": "Hi!"}]
    docs = [{"title": "a", "text": "Paris is in France."}]
    fields = {"chat_template": template, "documents": docs}
    ids = httpx.post(server.base + "/tokenize", json={"messages": msgs, **fields},
                     timeout=60).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=60).json()
    assert text["prompt"] == "[doc a] Paris is in France.\n<user>Hi!\n"
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       temperature=0, extra_body=fields)
    assert r.usage.prompt_tokens == len(ids)
    open_msgs = msgs + [{"role": "assistant", "content": "The capital of France is"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(model=MODEL, messages=open_msgs, max_tokens=4,
                                           temperature=0, extra_body=cont)
    echoed = client.chat.completions.create(model=MODEL, messages=open_msgs, max_tokens=4,
                                            temperature=0, extra_body={**cont, "echo": True})
    want = "The capital of France is" + plain.choices[0].message.content
    assert echoed.choices[0].message.content == want
    chunks = client.chat.completions.create(model=MODEL, messages=open_msgs, max_tokens=4,
                                            temperature=0, stream=True,
                                            extra_body={**cont, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_return_token_ids(server, client):
    """vLLM's ``return_token_ids``: the prompt's ids (a stream's first chunk) and each
    choice's generated ids (streamed: chunk by chunk), which decode to its text."""
    extra = {"return_token_ids": True}
    ids = httpx.post(server.base + "/tokenize", json={"prompt": ECHO_PROMPT},
                     timeout=60).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=6,
                                  temperature=0, extra_body=extra)
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == r.usage.completion_tokens
    text = httpx.post(server.base + "/detokenize", json={"tokens": c["token_ids"]},
                      timeout=60).json()["prompt"]
    assert text == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=6,
                                            temperature=0, stream=True, extra_body=extra))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert all(ch.choices[0].model_extra["prompt_token_ids"] is None for ch in chunks[1:])
    assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"] or []] \
        == c["token_ids"]
    msgs = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                          temperature=0, extra_body=extra)
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    want = chat.choices[0].model_extra["token_ids"]
    assert len(want) == chat.usage.completion_tokens
    stream = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                                 temperature=0, stream=True, extra_body=extra))
    assert stream[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for ch in stream if ch.choices
            for t in ch.choices[0].model_extra["token_ids"] or []] == want


def test_allowed_token_ids(server, client):
    """vLLM's ``allowed_token_ids``: every generated token is one of them, greedy or
    sampled, in completions and chat."""
    allowed = httpx.post(server.base + "/tokenize", json={"prompt": " yes no maybe",
                                                          "add_special_tokens": False},
                         timeout=60).json()["tokens"]
    extra = {"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5,
                                  temperature=1.0, seed=3, extra_body=extra)
    got = r.choices[0].model_extra["token_ids"]
    assert len(got) == 5 and set(got) <= set(allowed)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=3,
        temperature=0, extra_body=extra)
    assert set(chat.choices[0].model_extra["token_ids"]) <= set(allowed)


def test_bad_words(client):
    """vLLM's ``bad_words``: the greedy answer's first word, banned, is not generated (it is
    banned as sent and after a space), and the answer changes, in completions and chat.
    (Multi-token words: ``test_sampler.py``.)"""
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      temperature=0).choices[0].text
    assert plain.startswith(" Paris")
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                       temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text and banned.choices[0].text != plain
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in chat.choices[0].message.content


def test_cache_salt(client):
    """vLLM's ``cache_salt`` over HTTP: the second request of a salt hits its prefix cache,
    another salt's does not."""
    prompt = ECHO_PROMPT * 4 + " Unique salt test."

    def cached(salt: str) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                      extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("one") == 0
    assert cached("two") == 0
    assert cached("one") > 0


def _ids(server, **body) -> list[int]:
    return httpx.post(server.base + "/tokenize", json=body, timeout=60).json()["tokens"]


def test_truncation_side(server, client):
    """vLLM's ``truncation_side``: "right" serves the prompt's first k tokens, "left" (the
    default) its last k, each as if only they were sent; chat prompts too."""
    ids = _ids(server, prompt=ECHO_PROMPT)
    for side, kept in (("right", ids[:5]), ("left", ids[-5:])):
        cut = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=4,
                                        temperature=0, extra_body={
                                            "truncate_prompt_tokens": 5, "truncation_side": side,
                                            "return_token_ids": True})
        alone = client.completions.create(model=MODEL, prompt=kept, max_tokens=4, temperature=0)
        assert cut.choices[0].model_extra["prompt_token_ids"] == kept
        assert cut.choices[0].text == alone.choices[0].text
    msgs = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == _ids(server, messages=msgs)[:3]


def test_logprob_token_ids(server, client):
    """vLLM's ``logprob_token_ids``: every position lists exactly those tokens' logprobs in
    the order asked (a completion's first entry is the sampled token's, as always), the
    values the top logprobs give them; the text and the sampled tokens' logprobs do not
    change; chat and stream too."""
    prompt, as_ids = "The capital of France is", {"return_tokens_as_token_ids": True}
    top = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                    logprobs=5, extra_body=as_ids).choices[0]
    first = top.logprobs.top_logprobs[0]
    chosen = [int(k.split(":")[1]) for k in first][::-1] + [1234]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                    logprobs=1, extra_body={**as_ids,
                                                            "logprob_token_ids": chosen})
    c = got.choices[0]
    assert c.text == top.text and c.logprobs.token_logprobs == top.logprobs.token_logprobs
    for token, listed in zip(c.logprobs.tokens, c.logprobs.top_logprobs, strict=True):
        assert list(listed) == list(dict.fromkeys([token] + [f"token_id:{t}" for t in chosen]))
    assert {k: c.logprobs.top_logprobs[0][k] for k in first} == first
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
              extra_body={**as_ids, "logprob_token_ids": chosen})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 4
    assert all([t.token for t in pos.top_logprobs] == [f"token_id:{i}" for i in chosen]
               for pos in whole)
    streamed = [pos for ch in client.chat.completions.create(stream=True, **kw)
                if ch.choices and ch.choices[0].logprobs
                for pos in ch.choices[0].logprobs.content]
    assert [p.model_dump() for p in streamed] == [p.model_dump() for p in whole]


def test_repetition_detection(server, client):
    """vLLM's ``repetition_detection``: a greedy output that loops ends at the first token
    whose tail is the pattern's ``min_count``-th copy (finish reason "repetition", stop
    reason "repetition_detected"): the output without it, cut there; streamed the same."""
    prompt = "1 2 1 2 1 2 1 2 1 2"
    extra = {"return_token_ids": True, "ignore_eos": True}
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body=extra).choices[0]
    tokens = free.model_extra["token_ids"]
    rule = {"max_pattern_size": 4, "min_count": 3}
    cut = next(k for k in range(1, len(tokens) + 1) if any(
        k >= 3 * s and tokens[k - 3 * s:k - s] == tokens[k - 2 * s:k] for s in range(1, 5)))
    assert cut < len(tokens)  # the model loops
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                    extra_body={**extra, "repetition_detection": rule}
                                    ).choices[0]
    assert got.model_extra["token_ids"] == tokens[:cut]
    assert (got.finish_reason, got.model_extra["stop_reason"]) == ("repetition",
                                                                   "repetition_detected")
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={**extra, "repetition_detection": rule}) if ch.choices]
    assert "".join(ch.text for ch in chunks) == got.text
    assert chunks[-1].finish_reason == "repetition"


def test_return_prompt_text(client):
    """vLLM's ``return_prompt_text``: a chat answer carries the prompt as the chat template
    wrote it (a stream: its first chunk only); without it, none."""
    msgs = [{"role": "user", "content": "Hi!"}]
    want = "[user] Hi!\n[assistant] "
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       extra_body={"return_prompt_text": True})
    assert r.model_extra["prompt_text"] == want
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert plain.model_extra["prompt_text"] is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                 stream=True,
                                                 extra_body={"return_prompt_text": True}))
    assert [ch.model_extra["prompt_text"] for ch in chunks] == [want] + [None] * (
        len(chunks) - 1)


def test_reasoning_effort_goes_to_the_template(client):
    """OpenAI's ``reasoning_effort`` as vLLM gives it to the chat template: as itself, and as
    ``enable_thinking`` (false for "none") unless ``chat_template_kwargs`` set it; a
    template that reads neither (the server's own here) is refused with 400, as is a value
    OpenAI does not define."""
    reads = ("effort={{ reasoning_effort }} thinking={{ enable_thinking }}|"
             "{% for m in messages %}{{ m.content }}{% endfor %}")
    switch = ("{% if enable_thinking is defined and not enable_thinking %}/no_think "
              "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "Hi!"}]

    def prompt(**extra) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=1,
            extra_body={"return_prompt_text": True, "chat_template": reads, **extra}
        ).model_extra["prompt_text"]

    assert prompt(reasoning_effort="low") == "effort=low thinking=True|Hi!"
    assert prompt(reasoning_effort="none") == "effort=none thinking=False|Hi!"
    assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) \
        == "effort=none thinking=True|Hi!"
    assert prompt(chat_template=switch, reasoning_effort="none") == "/no_think Hi!"
    assert prompt(chat_template=switch, reasoning_effort="high") == "Hi!"
    for extra, words in (({"reasoning_effort": "low"}, "reads neither"),
                         ({"reasoning_effort": "extreme", "chat_template": reads},
                          "must be one of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                           extra_body=extra)
        assert info.value.body["param"] == "reasoning_effort"
        assert words in info.value.body["message"]

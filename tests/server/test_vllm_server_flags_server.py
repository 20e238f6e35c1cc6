"""vLLM's HTTP-server flags through a real ``tpserve serve`` (flags -> ServerConfig -> app
and uvicorn): HTTPS with a self-signed certificate, ``--root-path``,
``--disable-fastapi-docs``, ``--response-role``, ``--max-logprobs`` and
``--uvicorn-log-level``, and the frontend flags (``--enable-request-id-headers``, ...),
driven by the real openai client. The details of each are in
``tests/server/http/test_vllm_server_flags.py``."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.http.certs import self_signed, trusting
from tests.server.serverproc import ServerProcess

MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[ServerProcess, str, httpx.Client]]:
    key, cert = self_signed(tmp_path_factory.mktemp("tls"))
    s = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "512",
                      "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                      "--root-path", "/llm", "--disable-fastapi-docs",
                      "--response-role", "bot", "--max-logprobs", "3",
                      "--uvicorn-log-level", "info",
                      # vLLM's frontend flags
                      "--default-chat-template-kwargs", '{"enable_thinking": false}',
                      "--chat-template-content-format", "string",
                      "--enable-force-include-usage", "--return-tokens-as-token-ids",
                      "--exclude-tools-when-tool-choice-none", "--enable-request-id-headers",
                      "--enable-prompt-tokens-details", "--enable-server-load-tracking",
                      "--stream-interval", "2", "--logprobs-mode", "processed_logprobs",
                      "--responses-store-size", "4", wait=False)
    base = f"https://127.0.0.1:{s.port}"
    http = httpx.Client(verify=trusting(cert), timeout=120)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert s.proc.poll() is None, s.output()
            assert time.monotonic() < deadline, s.output()
            try:
                if http.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield s, base, http
    finally:
        http.close()
        assert s.stop() == 0, s.output()


def test_every_flag_in_one_server(server):
    s, base, http = server
    assert f"Uvicorn running on https://127.0.0.1:{s.port}" in s.output()  # uvicorn at info
    assert f"on https://127.0.0.1:{s.port}/llm" not in s.output()  # tpserve's at warning
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
    assert http.get(f"{base}/openapi.json").status_code == 404
    assert http.get(f"{base}/llm/docs").status_code == 404
    client = openai.OpenAI(base_url=f"{base}/llm/v1", api_key="none", max_retries=0,
                           http_client=http)
    answer = client.chat.completions.create(model=client.models.list().data[0].id,
                                            messages=MESSAGES, max_tokens=3,
                                            logprobs=True, top_logprobs=3)
    assert answer.choices[0].message.role == "bot"
    assert all(len(t.top_logprobs) == 3 for t in answer.choices[0].logprobs.content)
    # closed here: an abandoned stream closed later by the garbage collector, inside
    # httpcore's pool lock (a request of the same client), deadlocks on that lock
    with client.chat.completions.create(model=answer.model, messages=MESSAGES,
                                        max_tokens=2, stream=True) as stream:
        first = next(iter(stream))
    assert first.choices[0].delta.role == "bot"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=answer.model, messages=MESSAGES, max_tokens=2,
                                       logprobs=True, top_logprobs=4)
    assert err.value.body["param"] == "top_logprobs"
    assert err.value.body["message"] == ("Requested top_logprobs of 4, which is greater "
                                         "than max allowed: 3")


def test_vllm_frontend_flags(server):
    """The frontend flags reach the app: the request id comes back, a stream ends with its
    usage unasked, logprob tokens are token ids, ``/load`` answers, stream chunks carry two
    tokens."""
    _, base, http = server
    r = http.post(f"{base}/v1/completions", headers={"X-Request-Id": "r-7"}, json={
        "prompt": "Hi", "max_tokens": 2, "logprobs": 1, "temperature": 0})
    assert r.headers["x-request-id"] == "r-7"
    assert all(t.startswith("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"])
    with http.stream("POST", f"{base}/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 2, "stream": True}) as stream:
        lines = [ln for ln in stream.iter_lines() if ln.startswith("data: {")]
    assert '"completion_tokens":2' in lines[-1].replace(" ", "")
    assert http.get(f"{base}/load").json() == {"server_load": 0}
    with http.stream("POST", f"{base}/v1/completions", json={
            "prompt": "Hi", "max_tokens": 7, "stream": True, "ignore_eos": True,
            "return_token_ids": True}) as stream:
        chunks = [json.loads(ln[6:]) for ln in stream.iter_lines() if ln.startswith("data: {")]
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks
             if c["choices"] and c["choices"][0]["token_ids"]]
    assert sizes == [1, 2, 2, 2]  # --stream-interval 2: the first token at once


def test_processed_logprobs_mode(server):
    """``--logprobs-mode processed_logprobs``: a sampled row's logprobs are those of the
    distribution it was drawn from, after top-k: at each position exactly two tokens are
    finite, their probabilities sum to 1, and the sampled token is one of them; the third
    listed token reads as vLLM's floor for -inf."""
    _, base, http = server
    r = http.post(f"{base}/v1/completions", json={
        "prompt": "Hi", "max_tokens": 6, "logprobs": 3, "temperature": 1.0, "top_k": 2,
        "seed": 1, "ignore_eos": True}).json()["choices"][0]["logprobs"]
    assert len(r["top_logprobs"]) == 6
    for token, value, top in zip(r["tokens"], r["token_logprobs"], r["top_logprobs"],
                                 strict=True):
        kept = {t: v for t, v in top.items() if v > -9999.0}
        assert len(top) == 3 and len(kept) == 2
        assert sorted(top.values())[0] == -9999.0
        assert sum(math.exp(v) for v in kept.values()) == pytest.approx(1.0, abs=1e-5)
        assert kept[token] == value


def test_responses_are_stored(server):
    """``--responses-store-size``: a stored answer comes back by id, and a follow-up by
    ``previous_response_id`` is answered from the whole conversation (its prompt is
    longer by the first turn)."""
    _, base, http = server
    client = openai.OpenAI(base_url=f"{base}/llm/v1", api_key="none", max_retries=0,
                           http_client=http)
    first = client.responses.create(input="Name a colour.", max_output_tokens=4)
    assert first.store and client.responses.retrieve(first.id).output_text == first.output_text
    alone = client.responses.create(input="And another?", max_output_tokens=4, store=False)
    follow = client.responses.create(input="And another?", max_output_tokens=4,
                                     previous_response_id=first.id)
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens

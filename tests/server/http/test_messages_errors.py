"""Anthropic's error envelope on ``/v1/messages`` and ``/v1/messages/count_tokens``: every
error those paths answer (validation, model, API key, body size, overload, a dead engine,
a failure mid-stream) has Anthropic's shape and type, read by the real anthropic client;
the other endpoints keep OpenAI's. The app on a real uvicorn server over the fake engine."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app

API_KEY = "test-key"
MODEL = "smol"
BODY_LIMIT = 16 * 1024
ASK = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


@pytest.fixture(scope="module")
def base_url(engine) -> Iterator[str]:
    app = build_app(engine, served_model_names=(MODEL,), api_key=API_KEY,
                    max_request_body_bytes=BODY_LIMIT)
    with running(app) as url:
        yield url


@pytest.fixture(autouse=True)
def _reset(engine) -> None:
    engine.reset()


@pytest.fixture()
def client(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=20)


@pytest.fixture()
def http(base_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=20) as c:
        yield c


def anthropic_error(r: httpx.Response, status: int, type_: str) -> str:
    """The message of an error in Anthropic's envelope, after checking its whole shape."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body == {"type": "error",
                    "error": {"type": type_, "message": body["error"]["message"]}}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_request_errors_have_anthropics_envelope(http, base_url, path):
    # pydantic's validation (messages missing), the conversion's refusals, an unknown model
    assert "messages" in anthropic_error(http.post(path, json={"model": MODEL}), 400,
                                         "invalid_request_error")
    assert "image content blocks" in anthropic_error(http.post(path, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
        400, "invalid_request_error")
    if path == "/v1/messages":  # the chat machinery's refusal names the Messages field
        message = anthropic_error(http.post(path, json={
            "model": MODEL, "max_tokens": 10**6, "messages": ASK}), 400,
            "invalid_request_error")
        assert "max_tokens" in message and "max_completion_tokens" not in message, message
    # a turn with no content block (but a final assistant one: a prefill of nothing)
    assert "messages.0.content holds no content block" in anthropic_error(http.post(
        path, json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": []}]}), 400, "invalid_request_error")
    assert "claude-x" in anthropic_error(http.post(path, json={
        "model": "claude-x", "max_tokens": 4, "messages": ASK}), 404, "not_found_error")
    assert "invalid JSON" in anthropic_error(http.post(
        path, content=b"{", headers={"Content-Type": "application/json"}), 400,
        "invalid_request_error")
    # the middlewares' answers: the API key, the body's size
    with httpx.Client(base_url=base_url, timeout=20) as anon:
        anthropic_error(anon.post(path, json={"model": MODEL, "messages": ASK}), 401,
                        "authentication_error")
    big = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x" * BODY_LIMIT}]}
    assert str(BODY_LIMIT) in anthropic_error(http.post(path, json=big), 413,
                                              "request_too_large")


def test_the_anthropic_client_reads_each_error(client, base_url, engine):
    with pytest.raises(anthropic.NotFoundError, match="claude-x") as found:
        client.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    assert found.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": found.value.body["error"]["message"]}}
    with pytest.raises(anthropic.AuthenticationError, match="x-api-key"):  # a wrong key
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK)
    # a bearer token as the client's auth_token sends it
    assert anthropic.Anthropic(base_url=base_url, auth_token=API_KEY, api_key=None,
                               max_retries=0).messages.create(
        model=MODEL, max_tokens=4, messages=ASK).type == "message"
    engine.fail = "overload"
    with pytest.raises(anthropic.RateLimitError, match="too many requests") as limited:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    assert limited.value.response.headers["retry-after"] == str(engine.retry_after)
    engine.fail = "dead"
    with pytest.raises(anthropic.APIStatusError, match="rank 1 died") as dead:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert dead.value.status_code == 503
    assert dead.value.body["error"]["type"] == "api_error"
    engine.fail = "crash"  # an unexpected exception: the last-resort 500, logged
    with pytest.raises(anthropic.InternalServerError) as crashed:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert crashed.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "Internal server error"}}


def test_a_failure_mid_stream_is_an_error_event(client, http, engine):
    engine.fail = "midway"
    with http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 10,
                                                   "messages": ASK, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "error"
    assert "message_stop" not in kinds
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last == {"type": "error", "error": {"type": "api_error",
                                               "message": "engine died mid-request"}}
    with pytest.raises(anthropic.APIStatusError, match="engine died mid-request"):
        with client.messages.stream(model=MODEL, max_tokens=10, messages=ASK) as stream:
            list(stream)


def test_other_endpoints_keep_openais_envelope(http):
    for path, body in (("/v1/chat/completions", {"model": "claude-x", "messages": ASK}),
                       ("/v1/messages-not", {}), ("/v1/responses/input_tokens",
                                                  {"model": "claude-x", "input": "hi"})):
        r = http.post(path, json=body)
        assert r.status_code == 404, r.text
        assert set(r.json()) == {"error"}
        assert {"message", "type", "param", "code"} <= set(r.json()["error"])

"""vLLM's HTTP-server flags on the app, on a real uvicorn server over the fake engine:
TLS (``--ssl-*``, through ``ServerConfig.uvicorn_options`` as ``serve`` passes them),
``--root-path``, ``--disable-fastapi-docs``, ``--response-role`` and ``--max-logprobs``.
``tests/server/test_vllm_server_flags_server.py`` runs them all in a real ``tpserve
serve``; ``tests/test_cli.py`` checks their refusals."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest

from tests.server.http.certs import self_signed, trusting
from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.config import ServerConfig
from tpserve.server.http.app import build_app

KEY = "k"
MODEL = "smol"
MESSAGES = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


def app(engine, **kwargs):
    return build_app(engine, served_model_names=(MODEL,), api_key=KEY, **kwargs)


def client(base: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=20,
                         **kwargs)


def quiet(server: ServerConfig) -> dict:
    return {**server.uvicorn_options(), "log_level": "warning"}


def test_https_with_the_certificate_as_ca_and_plain_http_fails(engine, tmp_path):
    key, cert = self_signed(tmp_path)
    server = ServerConfig(ssl_keyfile=str(key), ssl_certfile=str(cert))
    assert server.scheme == "https"
    with running(app(engine), **quiet(server)) as url:
        assert url.startswith("https://")
        with httpx.Client(verify=trusting(cert)) as http:
            http.headers["Authorization"] = f"Bearer {KEY}"
            assert http.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
            answer = client(url, http_client=http).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=3)
            assert answer.choices[0].message.content
        with httpx.Client(verify=ssl.create_default_context()) as http:  # not trusted
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                http.get(f"{url}/health")
        plain = url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):  # uvicorn answers TLS only: the connection drops
            httpx.get(f"{plain}/health", timeout=5)


def test_client_certificates_when_required(engine, tmp_path):
    key, cert = self_signed(tmp_path)
    client_key, client_cert = self_signed(tmp_path, "client")
    server = ServerConfig(ssl_keyfile=str(key), ssl_certfile=str(cert),
                          ssl_ca_certs=str(client_cert), ssl_cert_reqs=ssl.CERT_REQUIRED)
    with running(app(engine), **quiet(server)) as url:
        with httpx.Client(verify=trusting(cert, (client_key, client_cert))) as http:
            assert http.get(f"{url}/health").status_code == 200
        with httpx.Client(verify=trusting(cert)) as http, pytest.raises(httpx.HTTPError):
            http.get(f"{url}/health")  # no client certificate: the handshake fails


def test_root_path_answers_with_and_without_the_prefix_and_keeps_the_key(engine):
    """FastAPI's root_path, as vLLM sets it: a proxy may pass the prefix on or strip it;
    the OpenAPI document names the prefix as its server; /v1 behind the prefix still
    needs the key."""
    with running(app(engine, root_path="/api/v1")) as url, httpx.Client(base_url=url) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        for path in ("/api/v1/v1/models", "/v1/models"):
            r = http.get(path, headers=auth)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, path
            assert http.get(path).status_code == 401, path  # the key under the prefix too
        assert http.get("/other/v1/models", headers=auth).status_code == 404
        for path in ("/api/v1/openapi.json", "/openapi.json"):
            assert http.get(path).json()["servers"] == [{"url": "/api/v1"}]
        assert "/api/v1/openapi.json" in http.get("/api/v1/docs").text
        answer = client(f"{url}/api/v1").chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3)
        assert answer.choices[0].message.content
    with running(app(engine)) as url:  # without it: no servers entry, no prefix
        assert "servers" not in httpx.get(f"{url}/openapi.json").json()
        assert httpx.get(f"{url}/api/v1/health").status_code == 404


def test_disable_fastapi_docs(engine):
    with running(app(engine, docs=False)) as url, httpx.Client(base_url=url) as http:
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            assert http.get(path).status_code == 404, path
        answer = client(url).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     max_tokens=3)
        assert answer.choices[0].message.content
    with running(app(engine)) as url:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_response_role(engine):
    with running(app(engine, response_role="bot")) as url:
        c = client(url)
        answer = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert answer.choices[0].message.role == "bot"
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                stream=True, n=2))
        firsts = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].delta.role]
        assert [(f.index, f.delta.role) for f in firsts] == [(0, "bot"), (1, "bot")]
        # without add_generation_prompt the answer continues the last message's turn (as
        # vLLM answers): the user's here, the assistant's when it is continued
        answer = c.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3,
            extra_body={"add_generation_prompt": False})
        assert answer.choices[0].message.role == "user"
        answer = c.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "The"}],
            max_tokens=3, extra_body={"add_generation_prompt": False,
                                      "continue_final_message": True})
        assert answer.choices[0].message.role == "assistant"


def test_max_logprobs_lowered(engine):
    with running(app(engine, max_logprobs=3)) as url, httpx.Client(base_url=url) as http:
        http.headers["Authorization"] = f"Bearer {KEY}"
        c = client(url)
        answer = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           logprobs=True, top_logprobs=3)
        assert all(len(t.top_logprobs) == 3 for t in answer.choices[0].logprobs.content)
        answer = c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=3)
        assert engine.params[answer.id].logprobs == 3 and answer.choices[0].logprobs
        for endpoint, body, field in (
                ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                          "top_logprobs": 4}, "top_logprobs"),
                ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 4},
                 "prompt_logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": 4}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 4}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "prompt_logprobs": 4}, "prompt_logprobs")):
            r = http.post(endpoint, json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and error["type"] == "invalid_request_error"
            assert error["message"] == (f"Requested {field} of 4, which is greater than max "
                                        "allowed: 3")


def test_max_logprobs_default_is_the_engine_limit(engine):
    with running(app(engine)) as url, httpx.Client(base_url=url) as http:
        http.headers["Authorization"] = f"Bearer {KEY}"
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "logprobs": True,
            "top_logprobs": 20})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "logprobs": True,
            "top_logprobs": 21})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == ("Requested top_logprobs of 21, which is "
                                                "greater than max allowed: 20")

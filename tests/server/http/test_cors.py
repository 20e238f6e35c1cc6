"""CORS (``--allowed-origins``): browsers' preflights are answered before the API-key
check, allowed origins get their headers on every answer, others and servers without the
flag get none. The app on a real uvicorn server over the fake engine."""

from __future__ import annotations

import argparse

import httpx
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app
from tpserve.server.http.cors import CorsConfig, parse_list

KEY = "k"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


def app(engine, cors):
    return build_app(engine, served_model_names=("smol",), api_key=KEY, cors=cors)


def test_allowed_origins_get_cors_headers_and_preflights_pass_the_key_check(engine):
    cors = CorsConfig(allowed_origins=("https://ui.example",))
    with running(app(engine, cors)) as url, httpx.Client(base_url=url) as http:
        r = http.options("/v1/chat/completions",
                         headers={"Origin": "https://ui.example", **PREFLIGHT})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = http.get("/v1/models", headers={"Origin": "https://ui.example",
                                           "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = http.get("/v1/models", headers={"Origin": "https://ui.example"})  # no key
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = http.options("/v1/chat/completions",
                         headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_without_the_flag_there_are_no_cors_headers(engine):
    with running(app(engine, None)) as url, httpx.Client(base_url=url) as http:
        r = http.get("/v1/models", headers={"Origin": "https://ui.example",
                                           "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = http.options("/v1/chat/completions",
                         headers={"Origin": "https://ui.example", **PREFLIGHT})
        assert "access-control-allow-origin" not in r.headers


def test_lists_are_json_as_in_vllm_or_comma_separated():
    assert parse_list('["*"]') == ("*",)
    assert parse_list("https://a.example, https://b.example") == (
        "https://a.example", "https://b.example")
    with pytest.raises(argparse.ArgumentTypeError, match="not a JSON list"):
        parse_list('["*"')
    with pytest.raises(argparse.ArgumentTypeError, match="a JSON list of strings"):
        parse_list("[1]")

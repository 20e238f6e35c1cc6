"""vLLM's request and output logging (``http/request_log.py``: ``--enable-log-requests``,
``--enable-log-outputs``, ``--max-log-len``) on a real uvicorn server over the fake engine,
driven by the openai client: what each line holds, cut to the length asked, for whole and
streamed answers of several choices; nothing when the flags are off."""

from __future__ import annotations

import logging

import openai
import pytest

from tests.server.http.fake_engine import FakeEngine
from tests.server.http.uvicorn_app import running
from tpserve.server.http.app import build_app
from tpserve.server.http.frontend import FrontendOptions
from tpserve.server.http.request_log import RequestLog

MODEL = "smol"
PROMPT = "Tell me a story about a fox and a dog"


@pytest.fixture(scope="module")
def engine(smollm2_tokenizer) -> FakeEngine:
    return FakeEngine(smollm2_tokenizer, max_model_len=256)


def serve(engine, log: RequestLog):
    return running(build_app(engine, served_model_names=(MODEL,), api_key=None,
                             frontend=FrontendOptions(request_log=log)))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=20)


def lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tpserve.requests" and r.levelno == level]


@pytest.mark.parametrize("max_len", [None, 6])
def test_requests_and_outputs_are_logged_cut_to_max_len(engine, caplog, max_len):
    caplog.set_level(logging.DEBUG, logger="tpserve.requests")
    cut = (lambda x: x) if max_len is None else (lambda x: x[:max_len])
    with serve(engine, RequestLog(inputs=True, outputs=True, max_len=max_len)) as url:
        r = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2,
                                           extra_body={"return_token_ids": True})
    rid = engine.started[-1]
    prompt_ids = engine.prompts[rid]
    (info, *answers) = lines(caplog, logging.INFO)
    assert info.startswith(f"request {rid}: prompt_tokens={len(prompt_ids)} "
                           "params=SamplingParams(n=2,")
    assert lines(caplog, logging.DEBUG) == [
        f"request {rid} prompt: {cut(engine.tokenizer.decode(cut(prompt_ids)))!r} "
        f"prompt_token_ids: {cut(prompt_ids)}"]
    assert sorted(answers) == sorted(
        f"response {rid} choice {c.index}: output {cut(c.text)!r} output_token_ids "
        f"{cut(c.token_ids)} finish_reason length" for c in r.choices)
    assert len(answers) == 2


def test_a_stream_logs_each_choice_whole_when_it_ends(engine, caplog):
    caplog.set_level(logging.INFO, logger="tpserve.requests")
    with serve(engine, RequestLog(outputs=True)) as url:
        stream = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=7, n=2,
            stream=True)
        texts = {0: "", 1: ""}
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    rid = engine.started[-1]
    got = lines(caplog, logging.INFO)
    assert len(got) == 2 and not any(g.startswith("request ") for g in got)  # inputs off
    for index, text in texts.items():
        line = next(g for g in got if g.startswith(f"response {rid} choice {index}: "))
        assert line.startswith(f"response {rid} choice {index}: output {text!r} "
                               "output_token_ids [")
        assert line.endswith("finish_reason length")


def test_nothing_is_logged_by_default(engine, caplog):
    caplog.set_level(logging.DEBUG, logger="tpserve.requests")
    with serve(engine, RequestLog()) as url:
        client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert lines(caplog, logging.INFO) == lines(caplog, logging.DEBUG) == []


def test_a_negative_max_len_is_refused():
    with pytest.raises(ValueError, match="--max-log-len must be >= 0"):
        RequestLog(max_len=-1)

"""``tpserve soak`` without a server: how each kind of answer is classified, the mix, the
metric and RSS readers, and the exit status, over ``httpx.MockTransport``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from tpserve.loadtest import soak
from tpserve.loadtest.soak import (
    ABORTED,
    COMPLETED,
    ERRORED,
    FAILED,
    RequestPlan,
    SoakSender,
    make_plans,
    metric_value,
    read_rss_mib,
    read_tree,
)
from tpserve.loadtest.soak.memory import compare
from tpserve.loadtest.soak.report import memory_lines

BASE = "http://soak.test"
MODEL = "fake"


def plan(**kw) -> RequestPlan:
    fields = dict(index=0, chat=False, stream=True, n=1, max_tokens=4, prompt="hello there",
                  num_words=2, include_usage=True)
    return RequestPlan(**{**fields, **kw})


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode())
                    + b"\n\n" for p in payloads)


def good_stream(body: dict) -> bytes:
    chat, n = "messages" in body, body.get("n", 1)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def choice(i: int, text: str, reason: str | None) -> dict:
        if chat:
            return {"index": i, "delta": {"content": text}, "finish_reason": reason}
        return {"index": i, "text": text, "finish_reason": reason}

    chunks: list[object] = []
    for i in range(n):
        chunks += [{"object": obj, "choices": [choice(i, " word", None)]},
                   {"object": obj, "choices": [choice(i, "", "length")]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({"object": obj, "choices": [], "usage": {
            "prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})
    return sse(*chunks, b"[DONE]")


def good_whole(body: dict) -> dict:
    chat, n = "messages" in body, body.get("n", 1)
    choices = [{"index": i, "finish_reason": "stop",
                **({"message": {"role": "assistant", "content": "ok"}} if chat
                   else {"text": "ok"})} for i in range(n)]
    return {"object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}


def good_answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    if body.get("stream"):
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=good_stream(body))
    return httpx.Response(200, json=good_whole(body))


def send(p: RequestPlan, handler: Callable, timeout: float = 30.0) -> soak.Outcome:
    async def go() -> soak.Outcome:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await SoakSender(client, BASE, MODEL, timeout).send(p)

    return asyncio.run(go())


def stream_of(content: bytes) -> Callable:
    return lambda _: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                    content=content)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_full_answers_complete(chat, stream, n):
    assert send(plan(chat=chat, stream=stream, n=n), good_answer).kind == COMPLETED


@pytest.mark.parametrize("content, why", [
    (sse({"object": "text_completion", "choices": [{"index": 0, "text": "a"}]}),
     "without [DONE]"),
    (sse(b"{not json", b"[DONE]"), "malformed"),
    (sse({"object": "text_completion", "choices": [{"index": 0, "finish_reason": "abort"}]},
         b"[DONE]"), "'abort'"),
    (sse(b"[DONE]"), "before a finish_reason"),
    (sse({"object": "text_completion", "choices": [{"index": 1, "finish_reason": "stop"}]},
         b"[DONE]"), "index 1"),
    (sse({"object": "text_completion", "choices": [{"index": 0, "finish_reason": "stop"}]},
         b"[DONE]"), "no usage chunk"),
    (sse({"error": "boom"}, b"[DONE]"), "without the envelope"),
])
def test_broken_streams_fail(content, why):
    outcome = send(plan(), stream_of(content))
    assert outcome.kind == FAILED and why in outcome.detail, outcome


def test_error_event_is_an_explicit_error():
    envelope = {"error": {"message": "engine died", "type": "service_unavailable"}}
    outcome = send(plan(), stream_of(sse({"object": "text_completion", "choices": []},
                                         envelope, b"[DONE]")))
    assert outcome.kind == ERRORED and "engine died" in outcome.detail and outcome.status is None


@pytest.mark.parametrize("status", [400, 429, 503])
def test_http_errors_in_the_envelope_are_explicit(status):
    envelope = {"error": {"message": "no", "type": "x", "param": None, "code": None}}
    outcome = send(plan(), lambda _: httpx.Response(status, json=envelope))
    assert (outcome.kind, outcome.status) == (ERRORED, status)


@pytest.mark.parametrize("response", [
    httpx.Response(500, text="Internal Server Error"),
    httpx.Response(400, json={"detail": "bad"}),
    httpx.Response(302, headers={"location": "/elsewhere"}),
])
def test_other_error_answers_fail(response):
    assert send(plan(), lambda _: response).kind == FAILED


@pytest.mark.parametrize("answer", [
    b"{not json",
    json.dumps({"object": "text_completion", "choices": []}).encode(),
    json.dumps({**good_whole({}), "usage": {"prompt_tokens": 3, "completion_tokens": 99,
                                            "total_tokens": 102}}).encode(),
    json.dumps({**good_whole({}), "object": "chat.completion"}).encode(),
])
def test_broken_whole_answers_fail(answer):
    outcome = send(plan(stream=False), lambda _: httpx.Response(200, content=answer))
    assert outcome.kind == FAILED, outcome


def test_a_hang_fails_and_a_broken_connection_fails():
    async def hang(_: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    outcome = send(plan(stream=False), hang, timeout=0.2)
    assert outcome.kind == FAILED and "hang" in outcome.detail

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    assert send(plan(), refuse).kind == FAILED


def test_client_aborts():
    async def slow(_: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    assert send(plan(abort_after_s=0.05), slow).kind == ABORTED
    outcome = send(plan(abort_after_events=1), good_answer)
    assert outcome.kind == ABORTED and "after 1 events" in outcome.detail
    # An abort planned after the end of the stream: the answer completed first.
    assert send(plan(abort_after_events=1000), good_answer).kind == COMPLETED


def test_the_mix_is_seeded_and_covers_every_kind():
    a = make_plans(np.random.default_rng(5), 400, 0.25)
    b = make_plans(np.random.default_rng(5), 400, 0.25)
    assert a == b
    assert {p.chat for p in a} == {True, False} and {p.stream for p in a} == {True, False}
    assert {p.n for p in a} == {1, 2}
    assert any(isinstance(p.stop, str) for p in a) and any(isinstance(p.stop, list) for p in a)
    assert all(1 <= p.max_tokens <= soak.MAX_OUTPUT_TOKENS for p in a)
    assert all(1 <= p.num_words <= soak.MAX_PROMPT_WORDS for p in a)
    assert 60 <= sum(p.abort_planned for p in a) <= 140
    assert any(p.abort_after_events is not None for p in a)
    assert any(p.abort_after_s is not None for p in a)
    assert not any(p.abort_planned for p in make_plans(np.random.default_rng(1), 50, 0.0))
    assert all(p.abort_planned for p in make_plans(np.random.default_rng(1), 50, 1.0))
    body = a[0].body(MODEL)
    assert body["model"] == MODEL and ("messages" in body) == a[0].chat


def test_metric_value_and_rss():
    text = ('# HELP tpserve:kv_cache_usage_perc x\n'
            'tpserve:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'tpserve:kv_cache_usage_perc_other{model_name="m"} 7.0\n'
            'tpserve:num_requests_running{model_name="a"} 1.0\n'
            'tpserve:num_requests_running{model_name="b"} 2.0\n')
    assert metric_value(text, "kv_cache_usage_perc") == 0.25
    assert metric_value(text, "num_requests_running") == 3.0
    assert metric_value(text, "num_requests_waiting") is None
    # a server started with --metrics-namespace vllm (or vLLM itself)
    assert metric_value(text.replace("tpserve:", "vllm:"), "num_requests_running") == 3.0
    assert read_rss_mib(os.getpid()) > 1


def test_tree_memory_covers_descendants_and_names_the_grower(tmp_path):
    """A child that grows by 64 MiB between two readings of this process's tree."""
    go = tmp_path / "go"
    code = ("import os, sys, time\n"
            "from tpserve.parallel.launch import name_this_process\n"
            "name_this_process('soak-child')\n"
            "kept = []\n"
            "print('ready', flush=True)\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
            "kept.append(bytearray(b'x') * (64 << 20))\n"
            "print('grown', flush=True)\n"
            "sys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        before = read_tree(os.getpid())
        go.touch()
        assert child.stdout.readline() == "grown\n"
        after = read_tree(os.getpid())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    names = {p.pid: p.name for p in after.processes}
    assert after.processes[0].pid == os.getpid() and names[child.pid] == "soak-child"
    rss = compare(os.getpid(), before, after, limit_mib=32)
    assert not rss["ok"] and rss["growth_mib"] >= 60
    assert rss["largest_growth"]["name"] == "soak-child"
    assert rss["largest_growth"]["growth_mib"] >= 60
    assert rss["gpu"] == {"measured": False, "note": after.gpu_note}
    assert after.gpu_note.startswith("not measured")
    lines = "\n".join(memory_lines(rss))
    assert f"most growth: soak-child (pid {child.pid})" in lines and "TOO MUCH" in lines


class FakeServer:
    """A MockTransport handler with /v1/models, /metrics and /health; ``running`` is what
    /metrics reports as running requests."""

    def __init__(self, running: float = 0.0, answer: Callable = good_answer):
        self.running = running
        self.answer = answer
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=(
                f'tpserve:num_requests_running{{model_name="m"}} {self.running}\n'
                'tpserve:num_requests_waiting{model_name="m"} 0.0\n'
                'tpserve:kv_cache_usage_perc{model_name="m"} 0.0\n'))
        self.bodies.append(json.loads(request.content))
        return self.answer(request)


def run_main(tmp_path: Path, server: FakeServer, monkeypatch, *extra: str) -> tuple[int, dict]:
    transport = httpx.MockTransport(server)
    real = httpx.AsyncClient

    def client(**kw) -> httpx.AsyncClient:
        return real(transport=transport, **kw)

    monkeypatch.setattr(httpx, "AsyncClient", client)  # every soak module uses it
    result = tmp_path / "soak.json"
    rc = soak.main(["--base-url", BASE + "/v1", "--num-requests", "40", "--concurrency", "8",
                    "--warmup-requests", "5", "--seed", "3", "--result-file", str(result),
                    "--server-pid", str(os.getpid()), "--max-rss-growth-mib", "10000",
                    "--no-progress", *extra])
    return rc, json.loads(result.read_text())


def test_main_passes_and_writes_the_counts(tmp_path, monkeypatch, capsys):
    server = FakeServer()
    rc, doc = run_main(tmp_path, server, monkeypatch)
    assert rc == 0 and doc["passed"]
    c = doc["counts"]
    assert c["total"] == 40 == c["completed"] + c["errored"] + c["aborted"] + c["failed"]
    assert c["failed"] == 0 and doc["warmup"]["total"] == 5
    assert len(server.bodies) == 45
    assert doc["pool"]["ok"] and doc["rss"]["ok"] and doc["health_status"] == 200
    assert doc["checks"] == {"outcomes": True, "pool_free": True, "healthy": True, "rss": True}
    assert "Result:                PASS" in capsys.readouterr().out


def test_main_fails_when_the_pool_stays_busy(tmp_path, monkeypatch):
    rc, doc = run_main(tmp_path, FakeServer(running=1.0), monkeypatch,
                       "--drain-timeout", "0.3")
    assert rc == 1 and not doc["passed"]
    assert doc["checks"]["pool_free"] is False and doc["pool"]["num_requests_running"] == 1.0


def test_main_fails_on_a_bad_answer(tmp_path, monkeypatch):
    truncated = stream_of(b": the server went quiet\n\n")

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return truncated(request) if body.get("stream") else good_answer(request)

    rc, doc = run_main(tmp_path, FakeServer(answer=answer), monkeypatch, "--abort-fraction", "0")
    assert rc == 1 and doc["counts"]["failed"] > 0
    assert all("without [DONE]" in f for f in doc["counts"]["failures"])


def test_bad_flags_exit_2(capsys):
    assert soak.main(["--num-requests", "0"]) == 2
    assert soak.main(["--abort-fraction", "1.5"]) == 2
    assert soak.main(["--server-pid", "999999999"]) == 2
    assert "--server-pid" in capsys.readouterr().err


def test_arguments_wire_into_any_parser():
    parser = argparse.ArgumentParser()
    soak.add_soak_arguments(parser)
    args = parser.parse_args([])
    assert (args.num_requests, args.concurrency, args.abort_fraction,
            args.max_rss_growth_mib, args.server_pid) == (2000, 32, 0.2, 200.0, None)

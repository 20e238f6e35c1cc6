"""Overload, shutdown, out-of-memory and bad input against a real server process."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.server.serverproc import SMALL, ServerProcess

PROMPT = "The capital of France is"
LONG = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
TOKEN_LIMIT = 2048  # prompt tokens (times n) queued or running before 429


def _stream_until_first_token(base: str, body: dict, opened: threading.Event,
                              result: dict) -> None:
    """Streams ``body``; records the finish reasons and whether [DONE] came."""
    reasons, done = [], False
    with httpx.Client(timeout=120) as c, c.stream("POST", base + "/v1/completions",
                                                  json=body) as r:
        result["status"] = r.status_code
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                opened.set()
                for ch in chunk.get("choices", []):
                    if ch.get("finish_reason"):
                        reasons.append(ch["finish_reason"])
    opened.set()
    result.update(reasons=reasons, done=done)


@pytest.fixture(scope="module", params=[("--no-engine-process",), ("--engine-process",)],
                ids=["in-process", "engine-process"])
def server(request):
    s = ServerProcess(*SMALL, "--max-num-seqs", "2", "--max-num-queued-requests", "1",
                      "--max-num-queued-tokens", str(TOKEN_LIMIT - 512),  # SMALL: 512 a step
                      "--shutdown-timeout", "4", *request.param)
    yield s
    s.stop()


def test_bad_input_gets_400_in_the_envelope(server):
    url = server.base + "/v1/completions"
    chat = server.base + "/v1/chat/completions"
    cases = [
        (url, {"prompt": PROMPT, "temperature": float("nan")}),
        (url, {"prompt": PROMPT, "max_tokens": 10**12}),
        (url, {"prompt": PROMPT, "max_tokens": -5}),
        (url, {"prompt": PROMPT, "n": -1}),
        (url, {"prompt": PROMPT, "n": 10**9}),
        (url, {"prompt": PROMPT, "top_p": "high"}),
        (url, {"prompt": list(range(1_000_000)), "max_tokens": 1}),  # a million tokens
        (url, {"prompt": [49152 + 5], "max_tokens": 1}),  # outside the vocabulary
        (url, {"prompt": ""}),
        (chat, {"messages": []}),
        (chat, {"messages": [{"role": "function", "name": "f", "content": "hi"}]}),
        (chat, {"messages": "hello"}),
    ]
    for u, body in cases:
        r = httpx.post(u, content=json.dumps(body, allow_nan=True),
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (body if len(str(body)) < 200 else "1M tokens", r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    bad_utf8 = b'{"prompt": "\xff\xfe", "max_tokens": 2}'
    r = httpx.post(url, content=bad_utf8, headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(url, content=b"x" * (17 * 2**20),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    assert httpx.get(server.base + "/health").status_code == 200


def test_queued_tokens_count_the_prompt_n_times(server):
    url = server.base + "/v1/completions"

    def post(num_tokens: int, n: int) -> httpx.Response:
        body = {"prompt": [100] * num_tokens, "n": n, "max_tokens": 1, "temperature": 0}
        return httpx.post(url, json=body, timeout=120)

    half = TOKEN_LIMIT // 2
    r = post(half, 2)  # 2 x 1024 = the limit exactly: accepted
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = post(half + 1, 2)  # 2 x 1025 = limit + 2: refused although the prompt is 1025;
    # no idle server admits it either, so a 400, not a 429 a client would retry forever
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "n x prompt tokens (2 x 1025 = 2050) exceed what this server admits at once " \
           f"({TOKEN_LIMIT}" in r.json()["error"]["message"]
    assert post(half + 1, 1).status_code == 200  # the same prompt once fits
    assert server.metric("num_requests_running") == 0


def test_overload_is_answered_with_429(server):
    opened = [threading.Event() for _ in range(3)]
    results = [{} for _ in range(3)]
    threads = [threading.Thread(target=_stream_until_first_token,
                                args=(server.base, LONG, opened[i], results[i]))
               for i in range(3)]
    for t in threads:
        t.start()
    for _ in range(1200):  # two run (--max-num-seqs 2) and the third waits, whichever
        if (server.metric("num_requests_running") == 2
                and server.metric("num_requests_waiting") == 1):
            break
        threading.Event().wait(0.1)
    assert server.metric("num_requests_running") == 2
    assert server.metric("num_requests_waiting") == 1
    r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    server.proc.send_signal(signal.SIGTERM)  # graceful shutdown with 3 streams in flight
    r = httpx.post(server.base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 503
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    for res in results:  # the long streams were ended explicitly, not cut off
        assert res["status"] == 200 and res["done"] and res["reasons"] == ["abort"]
    assert server.proc.wait(timeout=60) == 0


def _post_all(base: str, bodies: list[dict]) -> list[httpx.Response | None]:
    """Posts every body at once (one thread each); the responses in order."""
    results: list[httpx.Response | None] = [None] * len(bodies)

    def go(i: int) -> None:
        results[i] = httpx.post(base + "/v1/completions", json=bodies[i], timeout=120)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return results


def test_out_of_memory_in_a_step_is_survived():
    """Out-of-memory errors in the forward (step 4) and in sampling after the step's
    samples were stored (step 9), under concurrent requests: every request gets its full
    answer, the same greedy text as the same requests sent again after the faults (each
    fires once), the server stays healthy and every KV block returns to the pool."""
    s = ServerProcess(*SMALL, env={"TPSERVE_TEST_FAULT": "0:4:oom,0:9:oom-sample"})
    try:
        bodies = [{"prompt": f"{PROMPT} {i}", "max_tokens": 12, "ignore_eos": True,
                   "temperature": 0} for i in range(4)]
        faulted = _post_all(s.base, bodies)
        assert s.metric("oom_recoveries_total") == 2
        again = _post_all(s.base, bodies)
        assert s.metric("oom_recoveries_total") == 2
        for r, r2 in zip(faulted, again, strict=True):
            assert r is not None and r.status_code == 200, r
            assert r.json()["usage"]["completion_tokens"] == 12
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]
        assert httpx.get(s.base + "/health").status_code == 200
        assert s.metric("num_preemptions_total") >= 1
        assert s.metric("kv_cache_usage_perc") == 0
    finally:
        assert s.stop() == 0

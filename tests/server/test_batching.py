"""Continuous batching and client disconnects against a real tp 1 server of SmolLM2.

Ordering is asserted through a shared event log (which client saw what, in which order),
never through elapsed times."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest

from tests.server.serverproc import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a long story about a dragon who learns to cook."


@pytest.fixture(scope="module")
def server(small_server_8_seqs):
    """The session's SMALL server with --max-num-seqs 8 (tests/conftest.py), shared with
    test_tools_server, whose requests all complete. The streams the tests here hang up
    have left the engine by the end of the last test, which waits for that."""
    return small_server_8_seqs.wait_until_healthy()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


class EventLog:
    """Thread-safe, ordered record of ``(who, what)``; ``wait_for`` blocks with a timeout."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []
        self._cond = threading.Condition()

    def add(self, who: str, what: str) -> None:
        with self._cond:
            self.events.append((who, what))
            self._cond.notify_all()

    def count(self, who: str, what: str) -> int:
        with self._cond:
            return self.events.count((who, what))

    def wait_for(self, who: str, what: str, n: int = 1, timeout: float = 120) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.events.count((who, what)) >= n, timeout)
        assert ok, f"{who} did not reach {n} x {what!r} within {timeout} s: {self.events}"

    def index(self, who: str, what: str) -> int:
        with self._cond:
            return self.events.index((who, what))


def _stream(client: openai.OpenAI, log: EventLog, who: str, max_tokens: int,
            errors: list[BaseException], stop: threading.Event | None = None
            ) -> threading.Thread:
    """Streams a greedy completion in a thread: logs ``token`` per content chunk, then
    ``finish`` (or ``error``); once ``stop`` is set it hangs up instead (``closed``)."""

    def run() -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=PROMPT,
                                               max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            with chunks:
                for c in chunks:
                    if stop is not None and stop.is_set():
                        log.add(who, "closed")
                        return
                    if c.choices and c.choices[0].text:
                        log.add(who, "token")
                    if c.choices and c.choices[0].finish_reason:
                        assert c.choices[0].finish_reason == "length"
            log.add(who, "finish")
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
            log.add(who, "error")

    t = threading.Thread(target=run, name=who, daemon=True)
    t.start()
    return t


def test_short_request_completes_while_a_long_one_streams(client):
    log, errors, stop = EventLog(), [], threading.Event()
    long = _stream(client, log, "long", 200, errors, stop)
    log.wait_for("long", "token", 3)  # the long request is decoding

    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    log.add("short", "finish")
    # the long one keeps streaming after the short one finished: the short request was
    # batched into the running steps instead of waiting for the long one to finish
    log.wait_for("long", "token", log.count("long", "token") + 2)
    stop.set()
    long.join(timeout=120)
    assert not long.is_alive() and not errors, errors
    assert log.count("long", "finish") == 0, log.events  # 200 tokens take far longer


def test_late_request_gets_its_first_token_before_the_running_ones_finish(client):
    log, errors, stop = EventLog(), [], threading.Event()
    early = [f"early{i}" for i in range(3)]
    running = [_stream(client, log, who, 120, errors, stop) for who in early]
    for who in early:
        log.wait_for(who, "token", 3)
    late = _stream(client, log, "late", 8, errors)
    late.join(timeout=120)
    assert not late.is_alive()
    log.wait_for("late", "finish")
    stop.set()
    for t in running:
        t.join(timeout=120)
        assert not t.is_alive()
    assert not errors, errors

    # the late request's first token (and all of it) came while the others still decoded
    first, done = log.index("late", "token"), log.index("late", "finish")
    assert first < done
    for who in early:
        assert log.count(who, "finish") == 0, log.events
        after = [w for w, what in log.events[first + 1:] if what == "token"]
        assert who in after, log.events


def _open_and_abandon(port: int, body: bytes, opened: threading.Barrier,
                      hold: threading.Event, errors: list[BaseException]) -> None:
    """Sends a streaming request on a raw socket, waits, then closes the connection."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            opened.wait(timeout=60)
            hold.wait(timeout=60)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors.append(exc)


def _wait_metric(server: ServerProcess, name: str, pred, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = server.metric(name)
        if pred(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.mark.slow
def test_abandoned_streams_free_their_slots_and_kv_blocks(server, client):
    n = 40
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 300,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    opened, hold, errors = threading.Barrier(n + 1), threading.Event(), []
    threads = [threading.Thread(target=_open_and_abandon,
                                args=(server.port, body, opened, hold, errors), daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    opened.wait(timeout=60)
    # every request reached the engine (8 running, the rest waiting) ...
    in_engine = _wait_metric(
        server, "num_requests_running",
        lambda v: v + server.metric("num_requests_waiting") == n)
    assert in_engine + server.metric("num_requests_waiting") == n
    assert server.metric("num_requests_running") == 8
    assert server.metric("kv_cache_usage_perc") > 0
    time.sleep(0.5)  # ... and the running ones stream for a while
    hold.set()  # every client hangs up
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert not errors, errors

    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" Paris") and r.choices[0].finish_reason == "length"

    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _wait_metric(server, name, lambda v: v == 0) == 0, name
    total = server.metric("kv_blocks_total")
    assert total > 0
    assert _wait_metric(server, "kv_blocks_free", lambda v: v == total) == total

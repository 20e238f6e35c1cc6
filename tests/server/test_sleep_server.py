"""vLLM's sleep mode and pause endpoints through a real ``tpserve serve --enable-sleep-mode
--tensor-parallel-size 2`` (the session's shared one) on the embedded SmolLM2: both ranks
empty and refill their shards (level 2 reads the GGUF file again), driven by httpx and the
openai client. A request sent while asleep is answered after the wake-up with the text it
gets awake; a stream kept across a sleep ends with its whole greedy text; a sleep of mode
wait answers after the request in flight has ended; vLLM's collective_rpc reads the
weights again on both ranks; the state shows in /metrics, /memory and `tpserve memory`'s
table; bad values are 400s naming the parameter. (Behind --api-key:
tests/server/http/test_app.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.serverproc import ServerProcess
from tpserve.loadtest.memory.report import format_table

PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def server(small_server_tp2) -> ServerProcess:
    """The session's SMALL server at tp 2 with --enable-sleep-mode (tests/conftest.py),
    shared with test_engine_query and test_memory_server: every test leaves it awake."""
    return small_server_tp2.wait_until_healthy()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=120) as c:
        yield c


def complete(server, max_tokens: int = 48) -> str:
    client = server.client()
    return client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                     max_tokens=max_tokens, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def awake(server) -> str:
    """The greedy answer of the server awake, never slept."""
    return complete(server)


def wait_metric(server, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_a_request_sent_while_asleep_is_answered_after_the_wake_up(server, http, awake):
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    r = http.post("/sleep", params={"level": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["is_sleeping"] and body["level"] == 2 and len(body["ranks"]) == 2
    for rank in body["ranks"]:
        assert rank["weights_bytes"] > 0 and rank["kv_cache_bytes"] > 0
        assert rank["host_copy_bytes"] == 0
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert server.metric("engine_paused") == 1.0
    metrics = http.get("/metrics").text
    assert any(line.startswith("tpserve:engine_sleep_state{") and
               'sleep_state="discard_all"' in line and line.endswith(" 1.0")
               for line in metrics.splitlines())
    report = http.get("/memory").json()
    assert report["sleep"]["state"] == "discard_all"
    assert all(r["plan_disagreement"] is None for r in report["ranks"])
    assert ("asleep at level 2 (discard_all): weights and KV cache given back"
            in format_table(report).splitlines())

    answers: list[str] = []
    sender = threading.Thread(target=lambda: answers.append(complete(server)))
    sender.start()
    wait_metric(server, "num_requests_waiting", 1.0)
    assert answers == []
    r = http.post("/wake_up")
    assert r.status_code == 200, r.text
    assert r.json()["is_sleeping"] is False and len(r.json()["ranks"]) == 2
    sender.join(timeout=120)
    assert answers == [awake]
    assert http.get("/memory").json()["sleep"]["state"] == "awake"
    assert complete(server) == awake


def test_a_stream_kept_across_a_sleep_ends_with_its_whole_text(server, http, awake):
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=48,
                                       temperature=0, stream=True)
    pieces = [next(stream).choices[0].text]
    r = http.post("/sleep", params={"level": 1, "mode": "keep"})
    assert r.status_code == 200, r.text
    assert all(rank["host_copy_bytes"] == rank["weights_bytes"] for rank in r.json()["ranks"])
    assert http.post("/wake_up", params={"tags": "weights"}).json()["is_sleeping"] is True
    assert http.post("/wake_up", params=[("tags", "kv_cache")]).json()["is_sleeping"] is False
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == awake


def test_a_sleep_of_mode_wait_answers_after_the_request_in_flight_ends(server, http, awake):
    client = server.client()
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                       max_tokens=48, temperature=0, stream=True)
    pieces = [next(stream).choices[0].text]  # in flight when the sleep is asked
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.extend(c.choices[0].text for c in stream))
    reader.start()
    r = http.post("/sleep", params={"level": 1, "mode": "wait"})
    assert r.status_code == 200, r.text
    reader.join(timeout=30)  # ended in full, not cut (abort) nor held until a wake (keep)
    assert not reader.is_alive() and "".join(pieces + rest) == awake
    assert http.get("/is_sleeping").json()["is_sleeping"]
    assert http.post("/wake_up").json()["is_sleeping"] is False


def test_pause_resume_and_reset(server, http):
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.get("/is_paused").json() == {"is_paused": False}
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.content == b""
    # vLLM's level 0: a pause that counts as a sleep, ended by the "scheduling" tag
    assert http.post("/sleep", params={"level": 0, "mode": "keep"}).json() == {
        "is_sleeping": True, "level": 0, "ranks": []}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/wake_up", params={"tags": "scheduling"}).json() == {
        "is_sleeping": False, "ranks": []}
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_collective_rpc_reads_the_weights_again_on_both_ranks(server, http, awake, tmp_path):
    r = http.post("/collective_rpc", json={"method": "reload_weights"})
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    assert result["status"] == "reloaded" and result["path"] is None
    assert complete(server) == awake
    for body, param in (({"method": "sleep"}, "method"),
                        ({"method": "reload_weights", "args": ["x"]}, "args")):
        r = http.post("/collective_rpc", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/reload_weights", json={"path": str(tmp_path)})
    assert r.status_code == 400 and "no config.json" in r.json()["error"]["message"]
    r = http.post("/reload_weights", json={"folder": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "folder"


@pytest.mark.parametrize("path, params, param, message", [
    ("/sleep", {"level": 3}, "level", "level must be one of 0, 1, 2, got '3'"),
    ("/sleep", {"mode": "later"}, "mode", "mode must be one of abort, wait, keep"),
    ("/wake_up", {"tags": "gpu"}, "tags", "tags must be among weights, kv_cache"),
    ("/pause", {"clear_cache": "maybe"}, "clear_cache", "clear_cache must be true or false"),
])
def test_bad_values_are_400s_naming_the_parameter(http, path, params, param, message):
    r = http.post(path, params=params)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert error["type"] == "invalid_request_error"

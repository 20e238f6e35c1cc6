"""Engine queries through real servers and real clients, in both process layouts: the
question goes to the engine thread (over the command pipe with the engine process) and the
answer comes back to its own asker (on the output pipe). On CPU: ``/memory?fresh=true``
gathers every rank's figures now; ``/memory/snapshot`` without ``--memory-history`` is
refused in OpenAI's envelope saying how to turn it on (the refusal itself crosses the
pipe), and ``tpserve memory --snapshot`` reports it. A query nobody answers times out."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.serverproc import SMALL, ServerProcess, snapshot_cli
from tpserve.server.engine.errors import EngineTimeoutError
from tpserve.server.engine.front import EngineFront
from tpserve.server.engine_proxy import PipeTransport

HOW = "start the server with --memory-history [N] (CUDA only)"


def _ask_together(base: str, headers: dict[str, str]) -> tuple[list[httpx.Response],
                                                               httpx.Response]:
    """Four fresh memory reports and one snapshot, all in flight at once."""
    def get(path: str) -> httpx.Response:
        return httpx.get(base + path, headers=headers, timeout=120)

    with ThreadPoolExecutor(5) as pool:
        fresh = [pool.submit(get, "/memory?fresh=true") for _ in range(4)]
        snap = pool.submit(get, "/memory/snapshot")
        return [f.result() for f in fresh], snap.result()


def _check_refusal(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert HOW in err["message"]


def test_queries_cross_the_engine_process_pipe_at_tp2(tmp_path, small_server_tp2):
    """On the session's SMALL server at tp 2 (tests/conftest.py), shared with
    test_memory_server: rank gathers are compared with the count before the queries."""
    s = small_server_tp2.wait_until_healthy()
    before = httpx.get(s.base + "/memory", timeout=10).json()
    t0 = time.time()
    fresh, snap = _ask_together(s.base, {})
    bad = httpx.get(s.base + "/memory?fresh=maybe", timeout=10)
    cli = snapshot_cli(s.base, tmp_path / "snap.pickle")
    # the engine still serves after the queries
    r = s.client().completions.create(model="SmolLM2-135M-Instruct", prompt="Hi",
                                      max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    _check_refusal(snap)
    reports = [f.json() for f in fresh]
    assert all(f.status_code == 200 for f in fresh)
    # each asker got its own answer: every query gathered every rank once, in turn
    gathers = sorted(rep["rank_gathers"] for rep in reports)
    assert len(set(gathers)) == 4 and gathers[0] > before["rank_gathers"]
    for rep in reports:
        assert rep["tp"] == 2 and [x["rank"] for x in rep["ranks"]] == [0, 1]
        assert rep["ranks"][0]["age_s"] == rep["ranks"][1]["age_s"]  # read together
        assert rep["history"]["time"][-1] >= t0  # a point taken by the query itself
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.fresh"
    assert cli.returncode == 1
    assert "cannot read" in cli.stderr and "HTTP 400" in cli.stderr and HOW in cli.stderr
    assert not (tmp_path / "snap.pickle").exists()


def test_queries_in_process_and_the_snapshot_behind_the_api_key(tmp_path):
    s = ServerProcess(*SMALL, "--no-engine-process", "--api-key", "k")
    key = {"Authorization": "Bearer k"}
    try:
        t0 = time.time()
        fresh, snap = _ask_together(s.base, key)
        anonymous = httpx.get(s.base + "/memory/snapshot", timeout=10)
        replicas = [httpx.get(s.base + "/memory/snapshot", params={"replica": r},
                              headers=key, timeout=30) for r in (0, 1, -1)]
        cli = snapshot_cli(s.base, tmp_path / "snap.pickle", "--api-key", "k")
    finally:
        assert s.stop() == 0
    _check_refusal(snap)
    _check_refusal(replicas[0])
    assert [r.status_code for r in replicas[1:]] == [400, 400]
    assert "replica 1: this server runs one engine" in replicas[1].json()["error"]["message"]
    assert replicas[2].json()["error"]["param"] == "replica"
    for f in fresh:
        assert f.status_code == 200
        rep = f.json()
        assert rep["tp"] == 1 and rep["history"]["time"][-1] >= t0
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "invalid_request_error"
    assert cli.returncode == 1 and HOW in cli.stderr


class _Front(EngineFront):
    """An engine front over a real command pipe whose engine end never answers."""

    dead_reason = None

    def __init__(self, transport: PipeTransport):
        self._init_front(transport, "m", 16, None, 10, 1, 16, 0, 0, frozenset())


def test_an_unanswered_query_times_out_and_is_forgotten():
    engine_end, http_end = mp.Pipe(duplex=False)
    transport = PipeTransport(http_end, proc=None, reader=None)
    front = _Front(transport)
    with pytest.raises(EngineTimeoutError, match="did not answer 'memory_report' within"):
        asyncio.run(front.query("memory_report", timeout=0.2))
    assert engine_end.poll(10) and engine_end.recv() == ("query", 0, "memory_report")
    assert transport.answers == {}  # a late reply finds no asker
    assert EngineTimeoutError.status == 504

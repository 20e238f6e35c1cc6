"""``tpserve soak`` against a real ``tpserve serve``: 160 mixed requests, a fifth
of them aborted by the client, then an idle server with a free KV pool and bounded RSS over
its whole process tree; and a leak planted in the engine process is caught and named."""

from __future__ import annotations

import json

import pytest

from tests.server.serverproc import SMALL, ServerProcess
from tpserve.loadtest import soak
from tpserve.model.fault import FAULT_ENV

NUM_REQUESTS = 160


@pytest.mark.slow
def test_soak_ends_every_request_and_frees_the_pool(tmp_path):
    server = ServerProcess(*SMALL, "--max-num-seqs", "16")
    try:
        result = tmp_path / "soak.json"
        rc = soak.main([
            "--base-url", server.base, "--num-requests", str(NUM_REQUESTS),
            "--concurrency", "16", "--warmup-requests", "30", "--seed", "7",
            # short prompts and answers keep it near a minute on two CPU cores: the prefill
            # of the prompts is most of its work (up to 30 random words still take several
            # KV blocks a request)
            "--max-tokens", "8", "--max-prompt-words", "30",
            "--server-pid", str(server.proc.pid), "--result-file", str(result),
            "--no-progress",
        ])
        doc = json.loads(result.read_text())
        c = doc["counts"]
        assert rc == 0 and doc["passed"], json.dumps(doc, indent=1)
        assert c["total"] == NUM_REQUESTS == c["completed"] + c["errored"] + c["aborted"]
        assert c["failed"] == 0 and doc["warmup"]["failed"] == 0
        # Nothing here is over the context or the queue: any error would be a bug.
        assert c["errored"] == 0 and doc["warmup"]["errored"] == 0, c["error_examples"]
        assert c["aborted"] > 0 and c["completed"] > 0
        assert c["mix"]["n2"] > 0 and c["mix"]["with_stop"] > 0 and c["mix"]["streamed"] > 0

        assert doc["pool"]["ok"] and doc["health_status"] == 200
        assert server.metric("num_requests_running") == 0
        assert server.metric("num_requests_waiting") == 0
        assert server.metric("kv_cache_usage_perc") == 0
        assert server.metric("kv_blocks_free") == server.metric("kv_blocks_total")
        assert doc["rss"]["ok"] and doc["rss"]["growth_mib"] < 200
        # the tree: the HTTP process (root) and the engine process (the default layout)
        names = [p["name"] for p in doc["rss"]["processes"]]
        assert doc["rss"]["processes"][0]["pid"] == server.proc.pid
        assert "tpserve-engine" in names, names
        assert "Traceback" not in server.output(), server.output()[-6000:]
    finally:
        status = server.stop()
    assert status == 0


LEAK_MIB = 4  # kept by the engine process at every step


@pytest.mark.slow
def test_soak_catches_a_leak_in_the_engine_process(tmp_path, capsys):
    server = ServerProcess(*SMALL, "--max-num-seqs", "8",
                           env={FAULT_ENV: f"0:1:leak{LEAK_MIB}"})  # rank 0: the engine
    try:
        result = tmp_path / "soak.json"
        rc = soak.main([
            "--base-url", server.base, "--num-requests", "40", "--concurrency", "8",
            "--warmup-requests", "4", "--seed", "3", "--max-tokens", "8",
            "--max-prompt-words", "20", "--abort-fraction", "0",
            "--server-pid", str(server.proc.pid), "--max-rss-growth-mib", "100",
            "--result-file", str(result), "--no-progress",
        ])
        doc = json.loads(result.read_text())
        rss = doc["rss"]
        # 40 requests of up to 8 tokens take far more than 25 steps: > 100 MiB kept
        assert rc == 1 and not doc["passed"] and doc["checks"]["rss"] is False, rss
        assert doc["checks"]["outcomes"] and doc["checks"]["pool_free"]
        assert rss["largest_growth"]["name"] == "tpserve-engine", rss
        assert rss["largest_growth"]["growth_mib"] > 100
        engine = next(p for p in rss["processes"] if p["name"] == "tpserve-engine")
        assert engine["growth_mib"] == rss["largest_growth"]["growth_mib"]
        assert f"most growth: tpserve-engine (pid {engine['pid']})" in capsys.readouterr().out
    finally:
        server.stop()

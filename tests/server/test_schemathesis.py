"""Schemathesis against a real ``tpserve serve`` and its own ``/openapi.json``: every
operation, valid and invalid bodies, and never a 5xx."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import httpx
import pytest

from tests.server.serverproc import SMALL, ServerProcess

pytest.importorskip("schemathesis")

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
MAX_EXAMPLES = 11


@pytest.mark.slow
def test_no_server_errors_on_any_operation(tmp_path):
    server = ServerProcess(*SMALL, "--max-model-len", str(MAX_MODEL_LEN),
                           "--max-num-seqs", "16")
    try:
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.schemathesis_hooks",
               "TPSERVE_FUZZ_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "schemathesis.cli", "--no-color", "run",
               f"{server.base}/openapi.json",
               "--checks", "not_a_server_error",
               "--max-examples", str(MAX_EXAMPLES),
               "--seed", "1",
               "--workers", "1",
               "--request-timeout", "120",
               "--suppress-health-check", "all",
               "--output-sanitize", "false"]
        # In tmp_path: schemathesis keeps a crash cache (replayed by later runs) and
        # hypothesis a database in the working folder.
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=540)
        report = run.stdout[-6000:] + run.stderr[-3000:]
        assert run.returncode == 0, report
        selected = re.search(r"(\d+) selected / (\d+) total", run.stdout)
        assert selected and selected[1] == selected[2] and int(selected[1]) >= 8, report
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
        # A failure after the 200 of a stream is an SSE error event, not a 5xx: the log
        # shows it (and any unhandled error) as a traceback.
        log = server.output()
        assert "Traceback" not in log, log[-6000:]
    finally:
        status = server.stop()
    assert status == 0

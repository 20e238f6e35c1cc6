"""`tpserve loadtest` against a real `tpserve serve`, and the Docker image's entrypoint
command run directly (no Docker engine runs here, so the image itself is not built)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx

from tests.server.serverproc import new_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput"] + [
    f"{s}_{m}" for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
    for s in ("mean", "median", "std")] + ["p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms"]


def test_loadtest_against_tpserve_counts_what_the_server_counts(tmp_path, small_server):
    """Against the session's SMALL server (tests/conftest.py), shared with test_tp_serving:
    the server's token count is compared as a difference."""
    server = small_server.wait_until_healthy()
    before = server.metric("generation_tokens_total")
    result = tmp_path / "run.json"
    out = subprocess.run(
        [shutil.which("tpserve"), "loadtest", "--base-url", server.base,
         "--num-prompts", "12", "--max-concurrency", "4", "--random-input-len", "32",
         "--random-output-len", "8", "--ignore-eos", "--seed", "1", "--num-warmups", "0",
         "--no-progress", "--result-file", str(result)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(result.read_text())
    assert doc["completed"] == 12 and doc["failed"] == 0
    assert doc["total_output_tokens"] == 12 * 8
    # the server also generated the one token of the initial test request
    assert server.metric("generation_tokens_total") - before == doc["total_output_tokens"] + 1
    assert doc["total_input_tokens"] == 12 * 32
    for key in KEYS:
        assert isinstance(doc[key], (int, float)), key
    png = result.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Successful requests" in out.stdout


def test_the_image_entrypoint_serves_health():
    text = (ROOT / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    port = new_port()
    argv = [str(port) if a == "8000" else a for a in entry + cmd]  # the port: entrypoint's
    assert argv[:2] == ["tpserve", "serve"] and "--host" in argv
    argv[0] = shutil.which("tpserve")
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv + ["--kv-cache-memory", "512MiB"], stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_healthy(f"http://127.0.0.1:{port}",
                         lambda: None if proc.poll() is None else "entrypoint exited",
                         timeout=240)
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        finally:
            proc.terminate()
            assert proc.wait(timeout=60) == 0

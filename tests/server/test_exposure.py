"""A server reachable beyond loopback without an API key says so at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.server.serverproc import new_port
from tpserve.server.config import config_from_args
from tpserve.server.exposure import exposure_warning, is_loopback_host

WARNING = "without an API key"


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.7", False),
    ("my-host.example", False),
])
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


def test_exposure_warning_names_the_address_and_the_key_flag():
    message = exposure_warning("0.0.0.0", 8000, None)
    assert message is not None and "0.0.0.0:8000" in message and WARNING in message
    assert "--api-key" in message and "TPSERVE_API_KEY" in message
    assert exposure_warning("0.0.0.0", 8000, "k") is None
    assert exposure_warning("127.0.0.1", 8000, None) is None


def test_an_empty_api_key_variable_means_no_key(monkeypatch):
    from tpserve.cli import build_parser

    monkeypatch.setenv("TPSERVE_API_KEY", "")  # what compose passes when it is unset
    parser, _ = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).server.api_key is None
    monkeypatch.setenv("TPSERVE_API_KEY", "k")
    parser, _ = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).server.api_key == ("k",)


def test_serving_on_all_interfaces_without_a_key_logs_a_warning():
    port = new_port()
    env = {k: v for k, v in os.environ.items() if k != "TPSERVE_API_KEY"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpserve.cli", "serve", "--host", "0.0.0.0", "--port",
             str(port), "--log-level", "warning", "--kv-cache-memory", "64MiB"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            text = ""
            while WARNING not in text and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                log.seek(0)
                text = log.read()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    line = next((x for x in text.splitlines() if WARNING in x), None)
    assert line is not None, text[-3000:]
    assert "WARNING" in line and f"0.0.0.0:{port}" in line and "--api-key" in line

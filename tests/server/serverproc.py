"""Start a real ``tpserve serve`` subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tpserve.parallel.state import find_free_port


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 240):
        self.port = find_free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tpserve.server.cli", "serve", *args,
               "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout} s")

    def metric(self, name: str) -> float:
        """Sum of every sample of ``tpserve:<name>`` in /metrics."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(f"tpserve:{name}") and not line.startswith("#"):
                head, value = line.rsplit(" ", 1)
                if head.split("{")[0] == f"tpserve:{name}":
                    total += float(value)
                    found = True
        if not found:
            raise KeyError(name)
        return total

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


SMALL = ("--kv-cache-memory", "192MiB", "--max-model-len", "2048",
         "--max-num-batched-tokens", "512", "--check-integrity")

"""Start a real ``tpserve serve`` subprocess on a free port and wait until it is healthy."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import httpx
import openai

from tpserve.loadtest.soak.server_state import metric_value
from tpserve.parallel.state import find_free_port

_PORTS: set[int] = set()  # handed to servers of this test process, maybe not bound yet
_LOWEST_PORT = 10000
_RANDOM = random.Random()  # its own: a test that seeds ``random`` does not choose the port
# The polls below (/health while a server starts, /metrics) go through one client that
# keeps no connection open, as ``httpx.get`` does; but ``httpx.get`` builds a client, and
# with it an SSL context (about 30 ms of CPU), for every call: polling /health every 50 ms
# that way kept a third of a core busy while each server started.
_HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def _port_slice() -> range:
    """This test process's ports: below the kernel's ephemeral range, one slice per
    pytest-xdist worker. Empty where the ephemeral range cannot be read or leaves no room
    below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = (ephemeral - _LOWEST_PORT) // max(count, 1)
    if width < 1000:
        return range(0)
    start = _LOWEST_PORT + index * width
    return range(start, start + width)


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def new_port() -> int:
    """A free port for a server this process starts, not handed out before by this process
    (servers started together bind only seconds later, so the OS could offer the same free
    port twice).

    Drawn from below the kernel's ephemeral range where it can: a server binds its port
    seconds after the port was chosen (imports, the model load), and meanwhile the kernel
    hands ephemeral ports to every socket that binds port 0 or connects out (gloo's pairs
    of a tp server, clients), in this process or in the other pytest-xdist worker. Each
    xdist worker draws from its own slice, so two workers never pick the same port."""
    ports = _port_slice()
    for _ in range(100):
        port = _RANDOM.choice(ports) if ports else find_free_port()
        if port not in _PORTS and (not ports or _is_free(port)):
            _PORTS.add(port)
            return port
    raise RuntimeError("no new free port")


def wait_healthy(base: str, exited: Callable[[], str | None], timeout: float) -> None:
    """Polls ``base``/health until it answers 200. ``exited()`` returns a message when the
    server's process(es) have died (raises RuntimeError with it); TimeoutError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = exited()
        if gone is not None:
            raise RuntimeError(gone)
        try:
            if _HTTP.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server not healthy within {timeout} s")


class ServerProcess:
    """``tpserve serve ARGS`` on a free port; its output goes to a temporary log file (never
    a pipe nobody reads, which would block a chatty server), read with ``output()``.

    The constructor waits until the server is healthy; with ``wait=False`` it returns once
    the process is started and ``wait_until_healthy()`` waits. A start-up keeps about one
    of two cores busy (imports, then the model load, mostly one thread), so a module that
    needs several servers starts them all before waiting for the first."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 240,
                 log_level: str = "warning", wait: bool = True):
        self.port = new_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # the prefix of its /metrics series (--metrics-namespace)
        self.metrics_prefix = (args[args.index("--metrics-namespace") + 1]
                               if "--metrics-namespace" in args else "tpserve") + ":"
        self._final_output: str | None = None
        cmd = [sys.executable, "-m", "tpserve.cli", "serve", *args,
               "--port", str(self.port), "--log-level", log_level]
        self._log = tempfile.NamedTemporaryFile("w", prefix="tpserve-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self._timeout = timeout
        self._healthy = False
        if wait:
            self.wait_until_healthy()

    def wait_until_healthy(self) -> ServerProcess:
        """Waits (up to the constructor's ``timeout`` from now) until /health answers 200;
        stops the server and raises if it exits or does not get there. Returns self."""
        if self._healthy:
            return self

        def exited() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"server exited with {self.proc.returncode}:\n{self.output()}"

        try:
            wait_healthy(self.base, exited, self._timeout)
        except BaseException:
            self.stop()
            raise
        self._healthy = True
        return self

    def output(self) -> str:
        """Everything the server printed so far (stdout and stderr); after ``stop``, all
        it printed."""
        if self._final_output is not None:
            return self._final_output
        try:
            with open(self._log.name, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def metric(self, name: str) -> float:
        """Sum of every sample of ``tpserve:<name>`` (the server's prefix) in /metrics."""
        text = _HTTP.get(self.base + "/metrics", timeout=10).text
        total = metric_value(text, name, (self.metrics_prefix,))
        if total is None:
            raise KeyError(name)
        return total

    def wait_pool_free(self, timeout: float = 30) -> None:
        """Waits until the KV pool is free (``kv_cache_usage_perc`` 0: every request's blocks
        back, the last ones released as its step is finalized); AssertionError after
        ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while (usage := self.metric("kv_cache_usage_perc")) != 0.0:
            assert time.monotonic() < deadline, f"KV cache still {usage:.0%} used"
            time.sleep(0.2)

    def client(self, api_key: str = "none", timeout: float = 600) -> openai.OpenAI:
        """The real openai client on this server's /v1, without retries."""
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0,
                             timeout=timeout)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (if still running), wait, SIGKILL after ``timeout`` s; removes the log
        file. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        if self._final_output is None:
            self._final_output = self.output()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
        return self.proc.returncode


SMALL = ("--kv-cache-memory", "192MiB", "--max-model-len", "2048",
         "--max-num-batched-tokens", "512", "--check-integrity")


@contextlib.contextmanager
def stopped_on_exit(servers: dict[str, ServerProcess]) -> Iterator[dict[str, ServerProcess]]:
    """Yields ``servers`` (started together with ``wait=False``) and stops every one of them
    on the way out, whichever the tests waited for."""
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def snapshot_cli(base: str, path: str | os.PathLike, *extra: str) -> subprocess.CompletedProcess:
    """``tpserve memory --snapshot PATH`` against the server at ``base``."""
    return subprocess.run([sys.executable, "-m", "tpserve.cli", "memory", "--base-url", base,
                           "--snapshot", str(path), *extra],
                          capture_output=True, text=True, timeout=180)

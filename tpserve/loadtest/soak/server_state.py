"""What the soak reads from the server after the load: ``/metrics`` until idle, and
``/health``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tpserve.loadtest.soak.outcomes import clip

IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
METRIC_PREFIXES = ("tpserve:", "vllm:")  # tpserve's namespaces (--metrics-namespace)
POLL_S = 0.25


def metric_value(text: str, name: str,
                 prefixes: tuple[str, ...] = METRIC_PREFIXES) -> float | None:
    """Sum of every sample of ``tpserve:<name>`` (or ``vllm:<name>``: the first of
    ``prefixes`` found) in a Prometheus text page; None if absent."""
    for prefix in prefixes:
        full = prefix + name
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(full):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == full:
                total += float(value)
                found = True
        if found:
            return total
    return None


async def wait_until_idle(client: httpx.AsyncClient, base_url: str, timeout: float
                          ) -> dict[str, Any]:
    """Polls /metrics until no request runs or waits and the KV pool is free, or timeout."""
    start = time.monotonic()
    values: dict[str, float | None] = {}
    error = None
    while True:
        try:
            response = await client.get(f"{base_url}/metrics", timeout=min(timeout, 10.0))
            response.raise_for_status()
            values = {name: metric_value(response.text, name) for name in IDLE_GAUGES}
            error = None
        except (httpx.HTTPError, ValueError) as e:
            error = clip(f"{type(e).__name__}: {e}")
        idle = error is None and all(v == 0 for v in values.values())
        waited = time.monotonic() - start
        if idle or waited >= timeout:
            return {"ok": idle, "waited_s": round(waited, 3), "error": error, **values}
        await asyncio.sleep(POLL_S)


async def health_status(client: httpx.AsyncClient, base_url: str) -> int | str:
    """The status of GET /health (200 while the engine lives), or why there was none."""
    try:
        return (await client.get(f"{base_url}/health", timeout=10.0)).status_code
    except httpx.HTTPError as e:
        return clip(f"{type(e).__name__}: {e}")

"""The engine's periodic log line (vLLM's, off with ``--disable-log-stats``): throughput
since the last line, the queues, the KV pool, the prefix cache, its host tier (with
``--kv-offloading-size``) and, under speculative decoding, the share of draft tokens kept,
every
``--log-stats-interval`` seconds while the engine has worked or holds requests."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

logger = logging.getLogger("tpserve")

_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
             "prefix_cache_queries_total", "prefix_cache_hits_total",
             "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
             "kv_offload_stored_blocks_total", "kv_offload_loaded_blocks_total")


def stats_line(before: Mapping[str, float], now: Mapping[str, float], seconds: float
               ) -> str | None:
    """The line for the interval from ``before`` to ``now`` (two ``stats()`` readings
    ``seconds`` apart); None when the engine was idle then and is idle now."""
    delta = {k: now.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}
    running, waiting = int(now["num_requests_running"]), int(now["num_requests_waiting"])
    if not (delta["prompt_tokens_total"] or delta["generation_tokens_total"] or running
            or waiting):
        return None
    seconds = max(seconds, 1e-9)
    queries = delta["prefix_cache_queries_total"]
    hit_rate = f"{100 * delta['prefix_cache_hits_total'] / queries:.1f} %" if queries \
        else "-"
    used = int(now["kv_blocks_total"] - now["kv_blocks_free"])
    drafted = delta["spec_decode_num_draft_tokens_total"]
    spec = (f" | draft acceptance "
            f"{100 * delta['spec_decode_num_accepted_tokens_total'] / drafted:.1f} % of "
            f"{int(drafted)} tokens") if drafted else ""
    tier = ""
    if now.get("kv_offload_blocks_total"):  # the prefix cache's host tier
        full = 100 * now["kv_offload_blocks_used"] / now["kv_offload_blocks_total"]
        tier = (f" | host tier {full:.1f} % used, "
                f"{int(delta['kv_offload_stored_blocks_total'])} blocks stored, "
                f"{int(delta['kv_offload_loaded_blocks_total'])} loaded")
    return (f"engine: prompt {delta['prompt_tokens_total'] / seconds:.1f} tok/s, "
            f"generation {delta['generation_tokens_total'] / seconds:.1f} tok/s | "
            f"running {running}, waiting {waiting} reqs | KV cache "
            f"{100 * now['kv_cache_usage_perc']:.1f} % used ({used} of "
            f"{int(now['kv_blocks_total'])} blocks) | prefix cache hits {hit_rate} | "
            f"preemptions {int(delta['num_preemptions_total'])}{tier}{spec}")


class StatsLogger:
    """A daemon thread that logs ``stats_line`` every ``interval_s`` seconds until
    ``stop``. ``read`` is the engine's ``stats`` (safe to call from any thread)."""

    def __init__(self, read: Callable[[], Mapping[str, float]], interval_s: float):
        if interval_s <= 0:
            raise ValueError(f"--log-stats-interval must be > 0, got {interval_s}")
        self.read = read
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        before, t0 = dict(self.read()), time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                now, t1 = dict(self.read()), time.monotonic()
            except Exception:  # an engine that went away: its own failure is reported
                logger.debug("stats unavailable", exc_info=True)
                continue
            line = stats_line(before, now, t1 - t0)
            if line is not None:
                logger.info(line)
            before, t0 = now, t1

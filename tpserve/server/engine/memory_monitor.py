"""Live memory figures of every rank, for /metrics and /memory.

``MemoryMonitor`` lives on the engine thread's ``EngineCore``. Between steps the
``StepLoop`` calls ``sample``: at most every ``sample_s`` it reads rank 0's caching
allocator (host-side, no device sync) and appends one point to a bounded history (KV
usage, fragmentation, reserved and allocated bytes); at most every ``gather_s``, at tp > 1,
it also asks every rank for its allocator figures (``ModelRunner.gather_allocator``: rank 0
sends ``CMD_MEMORY`` and all ranks answer with one small all-gather, so every rank issues
the same collectives in the same order; the host waits once for the step in flight). The
other ranks' live figures are therefore at most ``gather_s`` old (``age_s`` says how old).
The start-up plans of every rank were gathered once by the runner; the first
allocator figures are gathered when the monitor is built (start-up, still lockstep).

``report`` may be called from any thread: it copies under a lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from tpserve.model.memory import AllocatorReading, read_allocator
from tpserve.model.runner import ModelRunner

SAMPLE_S = 2.0
GATHER_S = 10.0
HISTORY_LEN = 450  # 15 minutes at SAMPLE_S


class MemoryMonitor:
    def __init__(self, runner: ModelRunner, sample_s: float = SAMPLE_S,
                 gather_s: float = GATHER_S, history_len: int = HISTORY_LEN):
        self.runner = runner
        self.sample_s = sample_s
        self.gather_s = gather_s
        self.world_size = runner.comm.world_size
        self._lock = threading.Lock()
        self._history: deque[tuple[float, float, float, int, int]] = deque(maxlen=history_len)
        # built on rank 0 right after start-up, while ranks > 0 wait for commands: the
        # first gather is in lockstep
        self._live = (runner.gather_allocator() if self.world_size > 1
                      else [read_allocator(runner.device)])
        now = time.monotonic()
        self._read_at = [now] * self.world_size
        self._last_sample = float("-inf")
        self._last_gather = now if self.world_size > 1 else float("inf")
        self._gathers = 1 if self.world_size > 1 else 0  # every rank's figures gathered

    def refresh(self, kv_usage: float) -> None:
        """Engine thread, between steps: rank 0's reading and (tp > 1) every rank's
        gathered now, whatever the intervals; one history point."""
        self._last_sample = float("-inf")
        if self.world_size > 1:
            self._last_gather = float("-inf")
        self.sample(kv_usage)

    def sample(self, kv_usage: float) -> bool:
        """Engine thread, between steps: one history point when due; True when it also
        gathered every rank's figures (a collective: it counts as a heartbeat)."""
        now = time.monotonic()
        if now - self._last_sample < self.sample_s:
            return False
        self._last_sample = now
        gathered = self.world_size > 1 and now - self._last_gather >= self.gather_s
        if gathered:
            live = self.runner.gather_allocator()
            read_at = [now] * self.world_size
            self._last_gather = now
        else:
            live = [read_allocator(self.runner.device), *self._live[1:]]
            read_at = [now, *self._read_at[1:]]
        r0 = live[0]
        with self._lock:
            self._live, self._read_at = live, read_at
            self._gathers += gathered
            self._history.append((time.time(), kv_usage, r0.fragmentation, r0.reserved,
                                  r0.allocated))
        return gathered

    def live(self) -> list[AllocatorReading]:
        with self._lock:
            return list(self._live)

    def report(self) -> dict[str, Any]:
        """Per rank: the start-up plan (``COMPONENTS`` in bytes, total, held, num_blocks),
        the latest allocator figures and their age, and the plan's disagreement with the
        allocator (``(reserved - held) / held``; None off CUDA); plus rank 0's history and
        the host tier of the prefix cache (None without one)."""
        with self._lock:
            live, read_at, hist = list(self._live), list(self._read_at), list(self._history)
            gathers = self._gathers
        now = time.monotonic()
        plan0 = self.runner.plan
        sleep = self.runner.sleep_state
        # asleep, the plan's components are not held: no disagreement to report
        compared = plan0.device.startswith("cuda") and not (sleep.weights_asleep
                                                             or sleep.kv_asleep)
        ranks = []
        for rank, (plan, reading, at) in enumerate(zip(self.runner.rank_plans, live, read_at, strict=False)):
            ranks.append({
                "rank": rank, "plan": dict(plan), "allocator": reading.as_dict(),
                "age_s": round(now - at, 3),
                "plan_disagreement": (None if not compared
                                      else (reading.reserved - plan["held"]) / plan["held"])})
        host = self.runner.host_kv
        stream = self.runner.model.weight_stream
        return {
            "device": plan0.device, "tp": self.world_size, "block_size": plan0.block_size,
            "kv_source": plan0.kv_source,
            # the prefix cache's host tier (--kv-offloading-size), the same on every rank
            "host_tier": None if host is None else {
                "blocks": host.num_slots, "bytes": host.nbytes,
                "tokens": host.num_slots * plan0.block_size,
                "pinned": plan0.device.startswith("cuda")},
            # --cpu-offload-gb: the decoder layers streamed from host memory (every rank
            # streams the same layers, each its own shards)
            "weights_offloaded": None if stream is None else stream.report(),
            "sample_interval_s": self.sample_s,
            "rank_interval_s": self.gather_s, "rank_gathers": gathers, "ranks": ranks,
            "history": {"time": [h[0] for h in hist], "kv_usage": [h[1] for h in hist],
                        "fragmentation": [h[2] for h in hist],
                        "reserved": [h[3] for h in hist], "allocated": [h[4] for h in hist]},
            # sleep mode (model/sleep.py): what is given back now, the same on every rank
            "sleep": sleep.report(),
        }

"""The step's token budget, sized from live free-device-memory readings (rank 0's engine)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tpserve.server.engine.oom_hold import OomHold

logger = logging.getLogger(__name__)

MemoryReader = Callable[[torch.device], tuple[int, int]]  # device -> (free, total) bytes


class TokenBudget:
    """How many tokens the next step may batch.

    ``budget`` is the full ``max_tokens`` while free device memory stays at or above the
    start-up floor (the first reading, capped at 1 GiB), shrinks in proportion below it
    (another process is taking memory), and never drops under one block. After a step ran
    out of memory (``after_oom``) an ``OomHold`` caps it until readings show room again.

    Invariants: ``block_size <= budget <= max_tokens``, and ``budget <= hold.cap`` while
    ``hold`` exists; the device is read at most every ``read_interval_s`` seconds by
    ``refresh`` (0: at every call) and once by every ``after_oom``."""

    def __init__(self, max_tokens: int, block_size: int, bytes_per_token: int,
                 read_memory: MemoryReader, device: torch.device, read_interval_s: float):
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.bytes_per_token = max(1, bytes_per_token)  # device memory a step needs per token
        self._read_memory = read_memory
        self._device = device
        self._read_interval = read_interval_s
        self.free, _ = read_memory(device)
        self.floor = max(min(self.free, 1 << 30), 1)
        self.budget = max_tokens
        self.hold: OomHold | None = None
        self._last_read: float | None = None

    def refresh(self) -> None:
        """Re-reads free device memory (at most every ``read_interval_s``) and sizes the
        budget; a hold's ``cap`` doubles at a reading of at least its ``room`` and the hold
        ends when ``cap`` reaches ``max_tokens``."""
        now = time.monotonic()
        if self._last_read is not None and now - self._last_read < self._read_interval:
            return
        self._last_read = now
        self.free, _ = self._read_memory(self._device)
        ratio = min(self.free / self.floor, 1.0)
        budget = max(self.block_size, int(self.max_tokens * ratio))
        hold = self.hold
        if hold is not None and self.free >= hold.room:
            hold.cap = min(2 * hold.cap, self.max_tokens)
            if hold.cap >= self.max_tokens:
                self.hold = hold = None
                logger.info("free device memory is back (%d bytes): the out-of-memory "
                            "budget hold is released", self.free)
        self.budget = budget if hold is None else min(budget, hold.cap)

    def after_oom(self, failed_tokens: int) -> None:
        """A step of ``failed_tokens`` tokens ran out of device memory (its memory and the
        allocator's cache already released): reads free memory and holds the budget at half
        the failed step (at least one block), or tightens the hold already in place."""
        self.free, _ = self._read_memory(self._device)
        cap = max(self.block_size, min(self.budget, failed_tokens) // 2)
        need = failed_tokens * self.bytes_per_token
        hold = self.hold
        if hold is None:
            self.hold = OomHold(cap, need, self.free)
        else:
            self.hold = OomHold(min(cap, hold.cap), max(need, hold.need),
                                min(self.free, hold.free_at_oom))
        self.budget = min(self.budget, self.hold.cap)

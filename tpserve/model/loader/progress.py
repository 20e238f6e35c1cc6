"""Progress of loading a checkpoint's tensors: a bar redrawn in place on a terminal, log
lines anywhere else (a log file, a pipe, ``docker logs``), where a bar would become one
long line of carriage returns.

Plain writes on purpose, not tqdm: tqdm's default lock is a ``multiprocessing`` RLock, a
named semaphore registered with the resource tracker; the engine process ends with
``os._exit`` (no finalizers), so the tracker reported it leaked at every shutdown.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

logger = logging.getLogger("tpserve")

T = TypeVar("T")

BAR_EVERY_S = 0.1  # terminal redraws at most this often
LOG_EVERY_S = 5.0  # off a terminal: one line this often while loading, and one at the end
BAR_WIDTH = 30


class LoadProgress:
    """Counts ``total`` items of ``iterable`` for ``description``; ``enabled=False`` is silent.
    ``stream`` (default ``sys.stderr``) decides bar or log lines by ``isatty()``."""

    def __init__(self, total: int, description: str, enabled: bool = True,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.description = description
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.tty = enabled and _isatty(self.stream)

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        if not self.enabled:
            yield from iterable
            return
        start = last = self.clock()
        done = 0
        if not self.tty:
            logger.info("loading %s: %d tensors", self.description, self.total)
        for item in iterable:
            yield item
            done += 1
            now = self.clock()
            if now - last >= (BAR_EVERY_S if self.tty else LOG_EVERY_S):
                last = now
                self._report(done, now - start)
        elapsed = self.clock() - start
        if self.tty:
            self.stream.write("\r" + " " * len(self._bar(done, elapsed)) + "\r")
            self.stream.flush()
        logger.info("loaded %s: %d tensors in %.1f s", self.description, done, elapsed)

    def _bar(self, done: int, elapsed: float) -> str:
        frac = done / self.total if self.total else 1.0
        filled = int(BAR_WIDTH * min(frac, 1.0))
        return (f"Loading {self.description}: {frac:4.0%} |{'#' * filled}"
                f"{' ' * (BAR_WIDTH - filled)}| {done}/{self.total} tensors {elapsed:.1f} s")

    def _report(self, done: int, elapsed: float) -> None:
        if self.tty:
            self.stream.write("\r" + self._bar(done, elapsed))
            self.stream.flush()
        else:
            pct = done / self.total if self.total else 1.0
            logger.info("loading %s: %d/%d tensors (%.0f%%), %.1f s", self.description, done,
                        self.total, 100 * pct, elapsed)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False

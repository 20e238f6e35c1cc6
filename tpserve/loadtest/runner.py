"""One run of a load test: send prompts at their arrival times, at most max_concurrency at once.

A request "arrives" at its scheduled time and then waits for a concurrency slot; its
latencies are measured from when it is actually sent. When ``stop`` is set (Ctrl-C),
no further request is sent, requests in flight are cancelled, and the run returns what
had completed, marked interrupted.

Progress: a tqdm bar on a terminal; elsewhere (a pipe, a CI log) a line on stderr at most
every ``LINE_EVERY_S`` seconds and one at the end, never a bar of carriage returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

from tpserve.loadtest.arrivals import arrival_offsets
from tpserve.loadtest.client import RequestResult, Sender
from tpserve.loadtest.datasets import PromptSpec

LINE_EVERY_S = 5.0


class RunProgress:
    """Requests done out of ``total``: tqdm when ``stream`` is a terminal, else lines."""

    def __init__(self, total: int, desc: str | None, enabled: bool,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.clock = total, desc or "requests", clock
        tty = enabled and _isatty(self.stream)
        self.lines = enabled and not tty
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not tty, file=self.stream)
        self.done = 0
        self.start = self.last = clock()

    def update(self) -> None:
        self.done += 1
        self.bar.update(1)
        now = self.clock()
        if self.lines and now - self.last >= LINE_EVERY_S:
            self.last = now
            self._line(now)

    def close(self) -> None:
        self.bar.close()
        if self.lines:
            self._line(self.clock())

    def _line(self, now: float) -> None:
        self.stream.write(f"[loadtest] {self.desc}: {self.done}/{self.total} requests done, "
                          f"{now - self.start:.1f} s\n")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass(frozen=True)
class RunRecord:
    """The measured outcome of one run at one request rate.

    Invariant: len(results) + cancelled + not_sent == num_prompts.
    """

    request_rate: float
    num_prompts: int
    results: tuple[RequestResult, ...]
    duration: float
    interrupted: bool
    cancelled: int
    not_sent: int


async def run_once(
    sender: Sender,
    prompts: Sequence[PromptSpec],
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    seed: int,
    stop: asyncio.Event,
    progress: bool = False,
    desc: str | None = None,
) -> RunRecord:
    """Send every prompt once and measure it; see the module docstring."""
    offsets = arrival_offsets(len(prompts), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    bar = RunProgress(len(prompts), desc, progress)
    stopped = asyncio.ensure_future(stop.wait())
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    async def one(spec: PromptSpec) -> None:
        async with limit if limit is not None else contextlib.nullcontext():
            result = await sender.send(spec, start)
        results.append(result)
        bar.update()

    try:
        for spec, offset in zip(prompts, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.wait({stopped}, timeout=delay)
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(one(spec)))
        if tasks and not stop.is_set():
            everything = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
            await asyncio.wait({everything, stopped}, return_when=asyncio.FIRST_COMPLETED)
        end = time.perf_counter()
    finally:
        stopped.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    interrupted = stop.is_set()
    return RunRecord(
        request_rate=request_rate,
        num_prompts=len(prompts),
        results=tuple(results),
        duration=end - start,
        interrupted=interrupted,
        cancelled=len(tasks) - len(results),
        not_sent=len(prompts) - len(tasks),
    )

"""Ctrl-C handling: the first SIGINT asks the load test to stop; a second one aborts."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """Raised by unless_stopped when the stop event fired first."""


@contextlib.contextmanager
def sigint_sets(stop: asyncio.Event) -> Iterator[None]:
    """While active, SIGINT sets ``stop`` instead of raising KeyboardInterrupt.

    After the first SIGINT the default handler is back, so a second Ctrl-C raises
    KeyboardInterrupt and aborts without writing results. Outside the main thread
    (where signals cannot be handled) this does nothing.
    """
    loop = asyncio.get_running_loop()
    installed = False

    def on_sigint() -> None:
        if stop.is_set():
            return
        stop.set()
        print("\nInterrupted: cancelling requests in flight and writing what was measured "
              "(Ctrl-C again to abort)", file=sys.stderr)
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        pass
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T:
    """Await ``work``; if ``stop`` is set first, cancel it and raise Interrupted."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise Interrupted

"""Pausing the engine and sleep mode (vLLM's ``/pause``, ``/resume``, ``/sleep``,
``/wake_up``; the routes are ``http/control_routes.py``, the queries ``control.py``, the
ranks' side ``model/sleep.py``).

States: ``running``; ``draining`` (a pause or sleep of mode ``wait`` under way: the requests
accepted before it run to their end); ``paused`` (no step runs); ``asleep`` (paused, and
every rank's weights, KV pool and CUDA graphs given back).

What happens to the requests in flight when a pause or sleep starts (vLLM's ``mode``):
- ``abort``: every one ends now, finish reason ``abort``, as a client's abort would;
- ``wait``: they run to their end; the pause (and the sleep) completes after the last;
- ``keep``: they stay. A pause keeps their KV blocks and they continue at ``resume``; a
  sleep, which loses the pool's content, preempts them (their blocks freed, recomputed
  after wake-up, as any preemption).

Invariants:
- a request added while not ``running`` is held here (registered in the engine's
  ``requests``, so aborts and failures reach it), never in the scheduler, and enters it in
  arrival order at resume or at the wake-up that leaves nothing asleep;
- the engine steps only while ``running`` or ``draining`` (``may_step``);
- a pause or sleep completes with nothing in flight: the step in flight is read back first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tpserve.server.engine.request_state import RequestState

PAUSE_MODES = ("abort", "wait", "keep")
RUNNING, DRAINING, PAUSED, ASLEEP = "running", "draining", "paused", "asleep"


@dataclass
class Deferred:
    """A query answered later, after steps have run: ``ready()`` is asked after every
    step, and once it holds, ``finish()`` gives the answer (or raises the error)."""

    ready: Callable[[], bool]
    finish: Callable[[], Any]


@dataclass
class EnginePause:
    """The engine's pause state and the requests held while it is not running."""

    state: str = RUNNING  # asleep: the ranks' ``sleep.RankSleep`` holds the level
    paused_before_sleep: bool = False  # asleep: whether the sleep found the engine paused
    held: list[RequestState] = field(default_factory=list)
    # counts the drains begun and the resumes: a deferred answer waiting for a drain is
    # called off when it changes (a resume came, or another drain began after one)
    epoch: int = 0

    def begin_draining(self) -> int:
        """A pause or sleep of mode ``wait`` starts; returns its epoch."""
        self.state = DRAINING
        self.epoch += 1
        return self.epoch

    @property
    def may_step(self) -> bool:
        return self.state in (RUNNING, DRAINING)

    @property
    def holds(self) -> bool:
        """Whether a request added now is held (anything but running)."""
        return self.state != RUNNING

    def hold(self, state: RequestState) -> None:
        self.held.append(state)

    def drop(self, request_id: str) -> RequestState | None:
        """Takes a held request out (an abort); None if it is not held."""
        for i, s in enumerate(self.held):
            if s.request_id == request_id:
                return self.held.pop(i)
        return None

    def release(self) -> list[RequestState]:
        """Running again: the held requests, in arrival order, to enter the scheduler."""
        held, self.held = self.held, []
        self.state = RUNNING
        self.epoch += 1
        return held

    @property
    def num_held_sequences(self) -> int:
        return sum(s.params.n for s in self.held)

"""Requests waiting for their grammar: registered with the engine, not yet in the scheduler.

Owned and touched by the engine thread only (no locks), except ``num_sequences``, an int
that other threads read for the stats without iterating. Invariants:
- entries keep arrival order; ``pop_ready`` takes every entry whose compile has finished,
  in that order, and never blocks;
- a request is here at most once, with no sequences, seq ids or blocks;
- ``num_sequences`` is the sum of ``params.n`` over the entries;
- ``drop`` cancels its compile only when no other waiting request shares the future (a
  compile in flight is shared by every request with the same grammar).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.structured.compiler import GrammarCompiler


class AwaitingGrammar:
    """The waiting room of ``EngineCore``'s constrained requests whose grammar compiles."""

    def __init__(self, compiler: GrammarCompiler):
        self._compiler = compiler
        self._entries: dict[str, tuple[RequestState, Future]] = {}
        self.num_sequences = 0

    def __bool__(self) -> bool:
        return bool(self._entries)

    def hold(self, state: RequestState, future: Future) -> None:
        self._entries[state.request_id] = (state, future)
        self.num_sequences += state.params.n

    def pop_ready(self) -> list[tuple[RequestState, Future]]:
        """The entries whose compile is done (successful or not), removed, in arrival order."""
        ready = [(rid, e) for rid, e in self._entries.items() if e[1].done()]
        for rid, (state, _) in ready:
            del self._entries[rid]
            self.num_sequences -= state.params.n
        return [e for _, e in ready]

    def wait(self, timeout: float) -> float:
        """Waits up to ``timeout`` s for one of the compiles; returns the seconds waited
        (0 with nothing waiting)."""
        if not self._entries:
            return 0.0
        t = time.perf_counter()
        wait([f for _, f in self._entries.values()], timeout=timeout,
             return_when=FIRST_COMPLETED)
        return time.perf_counter() - t

    def drop(self, request_id: str) -> bool:
        """Takes the request out (an abort); whether it was waiting here."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        state, future = entry
        self.num_sequences -= state.params.n
        if all(f is not future for _, f in self._entries.values()):
            self._compiler.cancel(future)
        return True

    def drop_all(self) -> None:
        """Cancels every compile and forgets every entry (the engine failed)."""
        for _, future in self._entries.values():
            self._compiler.cancel(future)
        self._entries.clear()
        self.num_sequences = 0

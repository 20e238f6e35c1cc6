"""A worker-failure callback that has to exist before the object it notifies.

``join_group`` needs the ``on_failure`` callback before the engine (``AsyncEngine`` in the
server process, ``StepLoop`` in the engine process) can be built, and a worker can die
in between. :class:`LateBoundFailure` is that callback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LateBoundFailure:
    """``on_failure(reason)`` for ``join_group``, bound to its target later with ``bind``.

    Invariants:

    - ``always`` (if given) is called first with every failure, bound or not;
    - a failure before ``bind`` is logged and remembered, not delivered: ``bind`` returns
      the remembered reasons, oldest first, and the caller decides what to do with them
      (``early`` reads them before that);
    - from ``bind`` on, every failure goes to the target, outside the lock (the target may
      block or call back). Binding and remembering share one lock, so each failure is
      either remembered before ``bind`` returns or delivered to the target, never lost.
    """

    def __init__(self, always: Callable[[str], None] | None = None) -> None:
        self._always = always
        self._lock = threading.Lock()
        self._target: Callable[[str], None] | None = None
        self._early: list[str] = []

    def __call__(self, reason: str) -> None:
        if self._always is not None:
            self._always(reason)
        with self._lock:
            target = self._target
            if target is None:
                logger.error("a worker failed during start-up: %s", reason)
                self._early.append(reason)
                return
        target(reason)

    def early(self) -> list[str]:
        """The failures remembered so far (before ``bind``), oldest first."""
        with self._lock:
            return list(self._early)

    def bind(self, target: Callable[[str], None]) -> list[str]:
        """Sends every later failure to ``target``; returns those that came before."""
        with self._lock:
            self._target = target
            return list(self._early)

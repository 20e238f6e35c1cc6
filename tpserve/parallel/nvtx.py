"""Named ranges on an Nsight Systems timeline (NVTX), so a profile of a step reads by name:
``schedule``, ``prepare``, ``forward``, ``sample``, ``finalize`` on rank 0, ``prepare`` and
``forward`` on the other ranks, and one range per collective (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_reduce_min``).

``Ranges`` is built once per rank from ``--nvtx`` (``RunnerConfig.nvtx``) and passed down;
it holds no module-level state. Off (the default, and always off CUDA) ``range`` returns
one shared ``nullcontext``: a method call per range, nothing recorded.

NVTX markers are host-side: inside CUDA-graph capture they are pushed and popped on the
host like anywhere else and are NOT recorded into the graph, so a replayed step shows one
``forward`` range around the graph launch and no per-collective ranges (those appear for
eager steps only: large prefills, ``--enforce-eager``, CPU-side timelines of capture).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

_OFF = contextlib.nullcontext()


class Ranges:
    """``with ranges.range("forward"): ...`` pushes a named range and pops it on exit
    (exceptions included, so nesting stays balanced). ``push``/``pop`` are the NVTX
    functions (or any pair with their signature); both None: off."""

    def __init__(self, push: Callable[[str], Any] | None = None,
                 pop: Callable[[], Any] | None = None):
        if (push is None) != (pop is None):
            raise ValueError("Ranges needs both push and pop, or neither")
        self._push = push
        self._pop = pop

    @property
    def enabled(self) -> bool:
        return self._push is not None

    @classmethod
    def for_device(cls, enabled: bool, device: torch.device) -> Ranges:
        """NVTX ranges when ``enabled`` and ``device`` is CUDA; otherwise off."""
        if not enabled or device.type != "cuda":
            return cls()
        return cls(torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)

    def range(self, name: str) -> contextlib.AbstractContextManager[None]:
        if self._push is None:
            return _OFF
        return self._range(name)

    @contextlib.contextmanager
    def _range(self, name: str) -> Iterator[None]:
        self._push(name)
        try:
            yield
        finally:
            self._pop()


OFF = Ranges()

"""A step's prefill seats: vLLM's ``--max-num-partial-prefills`` (the sequences that get a
prefill chunk in one step) and ``--max-long-partial-prefills`` (the long ones among them),
as ``Scheduler.schedule`` hands them out (``scheduler.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpserve.server.engine.scheduler import SchedulerConfig
    from tpserve.server.engine.sequence import Sequence


@dataclass
class PrefillSeats:
    """The prefill chunks one step may still take: ``free`` in all, ``long_free`` of long
    ones (None: no cap); ``held`` maps each seat's sequence to whether its seat is long."""

    free: int | None
    long_free: int | None
    held: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, config: SchedulerConfig) -> PrefillSeats:
        return cls(config.max_num_partial_prefills or None,
                   config.max_long_partial_prefills or None)

    @property
    def full(self) -> bool:
        return self.free == 0

    @property
    def long_full(self) -> bool:
        return self.long_free == 0

    def allows(self, long: bool) -> bool:
        return self.free != 0 and not (long and self.long_free == 0)

    def take(self, seq: Sequence, long: bool) -> None:
        self.held[seq.seq_id] = long
        if self.free is not None:
            self.free -= 1
        if long and self.long_free is not None:
            self.long_free -= 1

    def give_back(self, seq: Sequence) -> None:
        """``seq``'s seat, if it holds one (it was taken out of the step)."""
        if seq.seq_id not in self.held:
            return
        long = self.held.pop(seq.seq_id)
        if self.free is not None:
            self.free += 1
        if long and self.long_free is not None:
            self.long_free += 1

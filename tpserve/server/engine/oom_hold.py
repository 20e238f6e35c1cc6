"""The reduced step budget after an out-of-memory step (``TokenBudget.after_oom``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OomHold:
    """The step token budget after a step ran out of device memory, held until free-memory
    readings show room again.

    - ``cap``: the most tokens a step may batch while the hold lasts; it starts at half the
      failed step's tokens (at least one block);
    - ``need``: the device memory the failed step is estimated to need (its tokens x the
      start-up profile's activation workspace per token), the largest over the failures
      of this hold;
    - ``free_at_oom``: the free-memory reading right after the failure (the failed step's
      memory and the allocator's cache released), the lowest over the failures.

    Invariants: while the hold exists, ``TokenBudget.budget <= cap``. ``cap`` grows
    (doubles) only at a reading ``>= free_at_oom + need``: memory the failed step could have
    used and did not have has come back since. A reading below that keeps ``cap``,
    however long it lasts (another process still holds the memory, or the step failed
    against the engine's own usage, which never comes back: then the budget stays reduced).
    The hold ends when ``cap`` reaches ``max_num_batched_tokens``. Another failure while it
    lasts halves ``cap`` again."""

    cap: int
    need: int
    free_at_oom: int

    @property
    def room(self) -> int:
        """The free memory a reading must show for ``cap`` to grow."""
        return self.free_at_oom + self.need

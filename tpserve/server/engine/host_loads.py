"""The host tier's loads in flight: which device blocks a load may still be writing, and
which sequences wait for them (``BlockManager``'s books; the copies are ``model/kv_offload``).

The loads one sequence's admission lists are one *batch*, numbered from 0 in the order
they are listed; they run beside the forward, on every rank's copy stream, in that order.
A sequence whose blocks a batch writes is held out of the steps (``Scheduler``) until rank
0 sees the batch done (``complete``), while the others run; the first step that computes
it *joins* the batch: every rank's forward stream waits for that batch's copies (a
device-side wait, free once they are done), because rank 0 seeing its own copies done
says nothing of another rank's.

Invariants:
- ``_block`` holds exactly the device blocks whose load is not yet joined and that still
  hold the entry loaded into them, each with its batch, in increasing batch order;
- a block a load may still be writing is read or written by a step only after a join of
  its batch: a sequence holding it is scheduled with a join (``take``), and a block taken
  for other content (``reused``: evicted, its store reads it, a step writes it) makes the
  next step join its batch before its copies run;
- batches ``<= joined`` are ordered before every later step on every rank; ``done`` (rank
  0's reading) and ``joined`` only grow.
"""

from __future__ import annotations

from collections.abc import Iterable


class HostLoads:
    """The books of the host tier's loads that no step has joined yet."""

    def __init__(self) -> None:
        self._block: dict[int, int] = {}  # device block -> batch writing it (ascending)
        self._seq: dict[int, int] = {}  # seq_id -> the newest batch its blocks wait for
        self.next_batch = 0  # the batch the next admission's loads go out in
        self.done = -1  # every batch <= done is complete on rank 0
        self.joined = -1  # every batch <= joined is ordered before every later step
        self._must_join = -1  # a batch the next step joins: one of its blocks was reused

    def new_batch(self) -> int:
        """The batch of the loads an admission is about to list."""
        self.next_batch += 1
        return self.next_batch - 1

    def loading(self, block: int, batch: int) -> None:
        """``block`` gets a load listed in ``batch``."""
        self._block[block] = batch

    def batch_of(self, block: int) -> int:
        """The batch still writing ``block``, or -1."""
        return self._block.get(block, -1)

    def wait(self, seq_id: int, batch: int) -> None:
        """Sequence ``seq_id`` reads blocks ``batch`` writes (no-op for -1)."""
        if batch > self.joined:
            self._seq[seq_id] = max(batch, self._seq.get(seq_id, -1))

    def forget(self, seq_id: int) -> None:
        """``seq_id`` holds no blocks any more."""
        self._seq.pop(seq_id, None)

    def reused(self, block: int) -> None:
        """``block`` is taken for other content: the next step joins its load first."""
        batch = self._block.pop(block, -1)
        self._must_join = max(self._must_join, batch)

    def waits(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is held: a batch its blocks wait for is neither seen done on
        rank 0 nor joined."""
        return self._seq.get(seq_id, -1) > max(self.done, self.joined)

    def complete(self, batch: int) -> None:
        """Rank 0 saw every batch up to ``batch`` done."""
        self.done = max(self.done, batch)

    def take(self, scheduled: Iterable[int]) -> int:
        """The step with sequences ``scheduled`` goes out: the newest batch it must join
        before it runs (-1: none; it may be one of its own, joined after its loads)."""
        join = self._must_join
        for seq_id in scheduled:
            join = max(join, self._seq.pop(seq_id, -1))
        self._must_join = -1
        if join <= self.joined:
            return -1
        self.joined = join
        while self._block:  # ascending: drop the joined front
            block, b = next(iter(self._block.items()))
            if b > join:
                break
            del self._block[block]
        return join

    def check_integrity(self, is_cached, seq_ids: set[int] | None) -> None:
        """Raise AssertionError unless every tracked block is cached and its batch listed,
        in ascending order, and (given the ids of the sequences holding blocks) only
        those wait."""
        batches = list(self._block.values())
        assert batches == sorted(batches), f"loads out of batch order: {batches}"
        assert all(self.joined < b < self.next_batch for b in batches), (
            f"a load's batch outside ({self.joined}, {self.next_batch}): {batches}")
        for block in self._block:
            assert is_cached(block), f"loading block {block} holds no cache entry"
        if seq_ids is not None:
            assert set(self._seq) <= seq_ids, (
                f"sequences without blocks wait for loads: {set(self._seq) - seq_ids}")

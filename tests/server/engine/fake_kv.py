"""``FakeKV``: the runners' side of the KV pool and the host tier on block contents, for
the block manager's and the scheduler's tests. Each block and host slot holds the tokens
whose K/V it would store (None: never written); a step's copies run as the runners run
them (``model/kv_offload.py``), except that a load lands in its block only when the test
says (``land``: a copy stream getting that far) or when a step joins its batch. So a block
a step touches before its load was joined ends up holding the wrong tokens."""

from __future__ import annotations

from collections.abc import Iterable

from tpserve.server.engine.block_manager import BlockManager, KVCopies
from tpserve.server.engine.sequence import Sequence


class FakeKV:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        bs = bm.block_size
        self.device: list[list] = [[None] * bs for _ in range(bm.num_blocks)]
        self.host: list[list] = [[None] * bs for _ in range(bm.host.num_slots if bm.host
                                                            else 0)]
        self.pending: list[tuple[int, int, list]] = []  # loads on their way: batch, block

    def land(self, batch: int) -> None:
        """Every load up to ``batch`` lands in its block (in the order they were given)."""
        for _, block, content in [p for p in self.pending if p[0] <= batch]:
            self.device[block] = content
        self.pending = [p for p in self.pending if p[0] > batch]

    def run_copies(self, scheduled: Iterable[Sequence] = ()) -> KVCopies:
        """The copies of a step computing ``scheduled``: the join, the stores, the loads
        (put on their way) and the join again."""
        copies = self.bm.take_copies(scheduled)
        self.land(copies.join)
        for b, slot in copies.stores:
            self.host[slot] = list(self.device[b])
        for (slot, b), batch in zip(copies.loads, copies.batches, strict=True):
            self.pending.append((batch, b, list(self.host[slot])))
        self.land(copies.join)
        return copies

    def at(self, seq: Sequence, pos: int) -> tuple[list, int]:
        """The block holding ``seq``'s position ``pos``, and the offset in it."""
        bs = self.bm.block_size
        return self.device[seq.block_ids[pos // bs]], pos % bs

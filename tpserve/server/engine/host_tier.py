"""The prefix cache's second tier: cached KV blocks kept in host memory (``--kv-offloading-size``).

A cached block the device pool evicts is copied to a host slot first, under its cache
entry (hash, serial and key, ``block_manager.CacheEntry``); a later prompt that misses the
device cache but finds the block here gets it copied back into a device block instead of
computing it again. This class keeps the slots' books on the scheduler's side; the copies
themselves are the runners' (``model/kv_offload.py``), issued in the order the block
manager lists them, all of a step's stores before its loads, before its forward.

Every slot ``0..num_slots-1`` is either free or holds exactly one entry, listed in the
LRU order (front: evicted first). A hash is held by at most one slot. The tier is
inclusive: a block loaded back stays here, so evicting it from the device again costs no
copy. A slot being loaded in the step now being planned is *pinned*: it is not evicted
(its content must still be there when the step's loads run) until ``unpin_all``, called
when the step's copies are handed to the runners.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class HostTier:
    """Slot bookkeeping of the host tier: ``num_slots`` blocks of host memory per rank."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(reversed(range(num_slots)))  # a stack: 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # held slots, front evicted first
        self._entry: list[Any] = [None] * num_slots  # the cache entry a slot holds
        self._slot_of: dict[bytes, int] = {}
        self._pinned: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def find(self, h: bytes) -> tuple[int, Any] | None:
        """``(slot, entry)`` of the block cached under hash ``h``, or None."""
        slot = self._slot_of.get(h)
        return None if slot is None else (slot, self._entry[slot])

    def entry(self, slot: int) -> Any:
        """The entry ``slot`` holds (it must hold one)."""
        entry = self._entry[slot]
        assert entry is not None, f"host slot {slot} holds nothing"
        return entry

    def pin(self, slot: int) -> None:
        """Keeps ``slot`` (to be loaded by the step being planned) until ``unpin_all``, and
        marks it recently used."""
        assert self._entry[slot] is not None, f"host slot {slot} holds nothing"
        self._pinned.add(slot)
        self._lru.move_to_end(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def store(self, entry: Any) -> int | None:
        """The slot to copy an evicted device block holding ``entry`` into, or None when no
        copy is needed or possible: the hash is held already (the same content; it is
        marked recently used), or every slot is pinned. A full tier evicts its least
        recently used unpinned slot."""
        held = self._slot_of.get(entry.hash)
        if held is not None:
            self._lru.move_to_end(held)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = next((s for s in self._lru if s not in self._pinned), None)
            if slot is None:
                return None
            del self._lru[slot]
            del self._slot_of[self._entry[slot].hash]
        self._entry[slot] = entry
        self._slot_of[entry.hash] = slot
        self._lru[slot] = None
        return slot

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is free or holds one entry, indexed once."""
        free, held = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a host slot is free twice"
        assert not free & held, f"host slots both free and held: {sorted(free & held)}"
        assert free | held == set(range(self.num_slots)), "a host slot is lost"
        for s in free:
            assert self._entry[s] is None, f"free host slot {s} holds an entry"
        assert len(self._slot_of) == len(held), "host index and slots disagree"
        for h, s in self._slot_of.items():
            assert s in held and self._entry[s].hash == h, f"host slot {s} is not {h!r}"
        assert self._pinned <= held, f"pinned host slots hold nothing: {self._pinned - held}"

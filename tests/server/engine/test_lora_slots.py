"""The engine's LoRA slot registry: start-up adapters in slots 0..n-1 with ids 0..n-1;
runtime loads take a free slot no live request runs under, each with a new id; a request
whose adapter was unloaded (its id no longer its slot's) is refused; without runtime
updates loads and unloads are refused."""

from __future__ import annotations

import pytest

from tpserve.model.lora.adapter import LoraConfig, LoraModule
from tpserve.server.engine.errors import InvalidRequestError
from tpserve.server.engine.lora_slots import LoraSlots


def _slots(runtime: bool = True) -> LoraSlots:
    return LoraSlots(LoraConfig((LoraModule("a", "/a"),), 3, 8, runtime_updates=runtime))


def test_loads_take_free_slots_with_new_ids():
    slots = _slots()
    assert slots.ids == [0, None, None]
    slots.check(0, 0)
    slots.check(None, None)  # the base model
    assert slots.reserve([]) == (1, 1)
    slots.commit(1, 1)
    assert slots.reserve([]) == (2, 2)  # reserving holds no slot until the commit ...
    assert slots.reserve([]) == (2, 3)  # ... but takes an id
    with pytest.raises(InvalidRequestError, match="every one of the 3 LoRA slots"):
        slots.reserve([2])  # slot 2 free but a request of an unloaded adapter still runs
    slots.commit(2, 3)
    slots.unload(1, 1)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.check(1, 1)
    assert slots.reserve([]) == (1, 5)  # the slot again, a new id: no stale cached blocks
    slots.commit(1, 5)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.check(1, 1)
    slots.check(1, 5)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.unload(2, 7)  # not the id the slot holds


def test_a_load_is_meant_for_the_free_slot_meant_for_no_load_longest():
    """What data-parallel replicas agree on: the slot a load is meant for depends on the
    loads and unloads alone, not on the live requests; never-used slots come first."""
    slots = LoraSlots(LoraConfig((LoraModule("a", "/a"),), 4, 8, runtime_updates=True))
    assert slots.reserve([]) == (1, 1)
    slots.commit(1, 1)
    slots.unload(1, 1)
    assert slots.reserve([]) == (2, 2)  # slot 1 was meant for a load, slot 2 never
    slots.commit(2, 2)
    assert slots.reserve([]) == (3, 3)
    slots.commit(3, 3)
    slots.unload(3, 3)
    assert slots.reserve([]) == (1, 4)  # slot 1 meant for load 1, slot 3 for load 3
    # two replicas told the same loads and unloads; on one, a request of the adapter
    # unloaded from slot 1 still runs: it takes another slot, the replicas disagree once
    # (data parallelism takes the load back), and the next load is meant for slot 2
    one, other = _slots(), _slots()
    for s in (one, other):
        s.commit(*s.reserve([]))
        s.commit(*s.reserve([]))
        assert s.ids == [0, 1, 2]
        s.unload(1, 1)
        s.unload(2, 2)
    assert one.reserve([1]) == (2, 3) and other.reserve([]) == (1, 3)  # unlike: undone
    assert one.reserve([1]) == other.reserve([]) == (2, 4)
    # a replica that refuses (every free slot busy) marks the meant slot all the same
    one, other = _slots(), _slots()
    for s in (one, other):
        s.commit(*s.reserve([]))
        s.commit(*s.reserve([]))
        s.unload(2, 2)
    with pytest.raises(InvalidRequestError, match="every one of the 3 LoRA slots"):
        one.reserve([2])
    assert other.reserve([]) == (2, 3)  # then unloaded again by data parallelism
    assert one.reserve([]) == other.reserve([]) == (2, 4)


def test_runtime_updates_off_refuses_loads_and_unloads():
    slots = _slots(runtime=False)
    for call in (lambda: slots.reserve([]), lambda: slots.unload(0, 0)):
        with pytest.raises(InvalidRequestError, match="runtime LoRA updates are off"):
            call()
    slots.check(0, 0)

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
    assert slots.reserve([]) == (2, 2)  # reserving holds nothing until the commit
    assert slots.reserve([]) == (2, 2)
    with pytest.raises(InvalidRequestError, match="every one of the 3 LoRA slots"):
        slots.reserve([2])  # slot 2 free but a request of an unloaded adapter still runs
    slots.commit(2, 2)
    slots.unload(1, 1)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.check(1, 1)
    assert slots.reserve([]) == (1, 3)  # the slot again, a new id: no stale cached blocks
    slots.commit(1, 3)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.check(1, 1)
    slots.check(1, 3)
    with pytest.raises(InvalidRequestError, match="was unloaded"):
        slots.unload(2, 7)  # not the id the slot holds


def test_runtime_updates_off_refuses_loads_and_unloads():
    slots = _slots(runtime=False)
    for call in (lambda: slots.reserve([]), lambda: slots.unload(0, 0)):
        with pytest.raises(InvalidRequestError, match="runtime LoRA updates are off"):
            call()
    slots.check(0, 0)

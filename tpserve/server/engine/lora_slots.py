"""Which LoRA adapter each slot holds, on the engine thread: the start-up adapters in
slots ``0..n-1``, and, with runtime updates (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
adapters loaded into free slots and unloaded later.

Every load gets a new id (the start-up adapters' ids are their slots); a request carries
its adapter's slot and id (``SamplingParams.lora_slot``, ``lora_id``) and the prefix cache
keys its blocks on the id, so a slot reloaded with another adapter never reuses the old
one's cached blocks. A request whose id is no longer its slot's (the adapter was unloaded
between the HTTP side resolving its name and the engine admitting it) is refused.

Invariant: a slot is free when it holds no loaded adapter (``ids[slot] is None``); it is
loaded into only when, besides, no live request runs under it (those keep the weights they
started with until they finish).

Data-parallel replicas (``data_parallel``) must load an adapter into the same slot with
the same id, yet their live requests differ. So the slot a load is meant for depends only
on what every replica is told alike: each load takes a new id, and is meant for the free
slot meant for no load for longest (never-used slots first), whether it then finds that
slot free of live requests, loads or is refused. A replica whose meant slot still serves
requests of an unloaded adapter takes the next one, and the replicas then disagree (the
data-parallel layer takes the load back and refuses it; the next load is meant for
another slot).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tpserve.model.lora.adapter import LoraConfig
from tpserve.server.engine.errors import InvalidRequestError


class LoraSlots:
    def __init__(self, cfg: LoraConfig):
        self.runtime_updates = cfg.runtime_updates
        self.ids: list[int | None] = [i if i < len(cfg.modules) else None
                                      for i in range(cfg.max_loras)]
        self._next_id = len(cfg.modules)
        # the id of the last load meant for each slot (-1: none; module doc)
        self._meant = [i if i < len(cfg.modules) else -1 for i in range(cfg.max_loras)]

    def check(self, slot: int | None, lora_id: int | None) -> None:
        """Refuses a request whose adapter is not the one its slot holds now."""
        if slot is None:
            return
        if not 0 <= slot < len(self.ids) or self.ids[slot] != lora_id:
            raise InvalidRequestError("the request's LoRA adapter was unloaded")

    def reserve(self, live_slots: Iterable[int]) -> tuple[int, int]:
        """A free slot no live request runs under, and the id of the adapter about to be
        loaded into it: ``(slot, id)``; the caller loads, then ``commit``s. The slot is
        the one the load is meant for, or where live requests still run under it the next
        free one in that order (module doc). Every call takes a new id and marks its meant
        slot, whether it finds a slot or not and whether the load succeeds or not, so
        that replicas asked every load and unload keep equal ids and marks."""
        if not self.runtime_updates:
            raise InvalidRequestError(
                "runtime LoRA updates are off: start the server with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (and --enable-lora)")
        lora_id = self._next_id
        self._next_id += 1
        order = sorted((s for s, i in enumerate(self.ids) if i is None),
                       key=lambda s: (self._meant[s], s))
        if order:
            self._meant[order[0]] = lora_id
        busy = set(live_slots)
        slot = next((s for s in order if s not in busy), None)
        if slot is None:
            raise InvalidRequestError(
                f"every one of the {len(self.ids)} LoRA slots holds an adapter or serves "
                "requests of an unloaded one: unload one, or raise --max-loras")
        return slot, lora_id

    def commit(self, slot: int, lora_id: int) -> None:
        self.ids[slot] = lora_id
        self._next_id = max(self._next_id, lora_id + 1)

    def stats(self, running: Iterable, waiting: Iterable) -> dict[str, Any]:
        """The adapters (ids) the ``running`` and ``waiting`` sequences run under, and the
        slots (vLLM's ``lora_requests_info``)."""
        def ids(seqs):
            return sorted({s.params.lora_id for s in seqs if s.params.lora_id is not None})
        return {"running": ids(running), "waiting": ids(waiting), "max_lora": len(self.ids)}

    def unload(self, slot: int, lora_id: int) -> None:
        """Frees ``slot`` (its live requests finish under its weights)."""
        if not self.runtime_updates:
            raise InvalidRequestError(
                "runtime LoRA updates are off: start the server with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (and --enable-lora)")
        self.check(slot, lora_id)
        self.ids[slot] = None

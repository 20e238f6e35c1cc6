"""The LoRA adapters an HTTP server serves by name (its side of ``server/engine/lora_slots``:
the engine owns the slots, this maps names to them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tpserve.model.lora.adapter import LoraModule


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    parent: str | None  # the model /v1/models names as its parent (None: the base model)
    slot: int
    lora_id: int


class LoraNames:
    """Adapter name -> ``ServedAdapter``: the start-up adapters (slot and id ``i``), then
    the runtime ones, in the order they were loaded. ``lock`` serializes changes."""

    def __init__(self, modules: tuple[LoraModule, ...] = ()):
        self.adapters = {m.name: ServedAdapter(m.name, m.path, m.base_model_name, i, i)
                         for i, m in enumerate(modules)}
        self.lock = asyncio.Lock()

    def get(self, name: str) -> ServedAdapter | None:
        return self.adapters.get(name)

    def names_by_id(self) -> dict[int, str]:
        """Adapter id -> name, for /metrics (read on the scrape's thread: a copy)."""
        return {a.lora_id: a.name for a in list(self.adapters.values())}

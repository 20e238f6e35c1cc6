"""Writes a checkpoint's tensors as safetensors shards of about ``shard_bytes`` each, with
the ``model.safetensors.index.json`` that names them (the benchmark checkpoint writers')."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 << 30


class ShardWriter:
    """``add`` tensors (on the CPU) in order; ``finish`` writes the last shard and the index
    and returns ``{"files": [...], "bytes": total}``."""

    def __init__(self, out: Path, shard_bytes: int = SHARD_BYTES):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.shard_bytes = out, shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.shard.update(tensors)
        self.size += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.size >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        fname = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.shard, str(self.out / fname), metadata={"format": "pt"})
        self.files.append(fname)
        self.weight_map.update(dict.fromkeys(self.shard, fname))
        self.shard, self.size = {}, 0

    def finish(self) -> dict:
        if self.shard:
            self._flush()
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.weight_map}, indent=1))
        return {"files": self.files,
                "bytes": sum((self.out / f).stat().st_size for f in self.files)}

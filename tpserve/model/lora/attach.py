"""Every LoRA-able layer of a model given its ``LoraStack`` of ``max_loras`` slots, and the
served adapters loaded into them, slot ``i`` holding ``LoraConfig.modules[i]``.

The LoRA-able layers are the projections ``adapter.TARGETS`` names: every
``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` (a mixture of experts'
shared expert and dense layers' too; its routed experts are not linear layers). Every rank
reads every adapter file and keeps its own shards, as it does the model's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.lora.adapter import FUSED, TARGETS, LoraConfig, read_adapter
from tpserve.parallel.linear import ColumnParallelLinear, RowParallelLinear
from tpserve.parallel.lora import LoraBatch, LoraStack, load_lora

LORA_LAYERS = frozenset(layer for layer, _ in TARGETS.values())


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``name -> layer`` of every LoRA-able linear layer of ``model``."""
    return {name: m for name, m in model.named_modules()
            if name.rpartition(".")[2] in LORA_LAYERS
            and isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def attach_lora(model: nn.Module, cfg: LoraConfig, batch: LoraBatch) -> int:
    """Gives every LoRA-able layer its (zero) slots and loads ``cfg``'s adapters; returns
    the bytes the slots take on this rank (their A rows live beside the layer's weight:
    ``LoraStack``). ValueError naming the adapter for one that does
    not fit the model (a layer it does not have, a shape that is not the layer's)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("this model has no layer LoRA applies to")
    nbytes = 0
    for layer in layers.values():
        layer.lora = LoraStack(layer, cfg.max_loras, cfg.max_lora_rank, batch)
        nbytes += sum(p.numel() * p.element_size() for p in layer.lora.parameters())
    for slot, module in enumerate(cfg.modules):
        load_adapter(layers, cfg.max_lora_rank, slot, module.name, module.path)
    return nbytes


def load_adapter(layers: dict[str, nn.Module], max_rank: int, slot: int, name: str,
                 path: str) -> None:
    """The adapter folder ``path`` (served as ``name``) into ``slot`` of ``layers``
    (``lora_layers``), every layer's slot cleared first, so the layers an adapter leaves
    out are zero. ValueError naming the adapter for one that does not fit the model (a
    layer it does not have, a shape that is not the layer's)."""
    clear_slot(layers, slot)
    adapter, tensors = read_adapter(path, max_rank)
    for (layer_name, part), (a, b) in tensors.items():
        layer = layers.get(layer_name)
        if layer is None:
            raise ValueError(f"LoRA adapter {name!r} ({path}): the model has no layer "
                             f"{layer_name}")
        try:
            for p, b_part in _parts(layer, part, b):
                load_lora(layer, slot, p, a, b_part, adapter.scale)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {name!r} ({path}): {layer_name}: {e}") from None


@torch.no_grad()
def clear_slot(layers: dict[str, nn.Module], slot: int) -> None:
    """Zeroes ``slot`` of every layer: tokens under it then get the base model."""
    for layer in layers.values():
        stack = layer.lora
        for part in stack.parts:
            cols = stack.columns(slot, part)
            stack.a[cols].zero_()
            stack.b[:, cols].zero_()


def _parts(layer: nn.Module, part: object, b):
    """``(part, B)`` of each part an adapter tensor pair covers: the one it names, or for a
    fused projection every part of the layer, B's rows split as the checkpoint stacks
    them (the parts share the one A)."""
    if part != FUSED:
        return [(part, b)]
    parts = layer.checkpoint_parts()
    rows = [layer.checkpoint_rows(p) for p in parts]
    if b.shape[0] != sum(rows):
        raise ValueError(f"a fused lora_B of {b.shape[0]} rows; the layer's parts have "
                         f"{' + '.join(map(str, rows))}")
    return list(zip(parts, b.split(rows), strict=True))

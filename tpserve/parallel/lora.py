"""LoRA adapters on the tensor-parallel linear layers: ``y = x W^T + sum_s [token in s]
(x A_s^T) B_s^T``, for every adapter slot ``s`` at once.

A layer's ``LoraStack`` holds ``slots`` adapters of rank at most ``rank`` for each of its
checkpoint parts (q/k/v, gate/up, or the one projection), stacked along the rank axis in
the order slot, part, rank: ``a [S*P*R, in_per_rank]`` and ``b [out_per_rank, S*P*R]``.
The shards follow the layer's weight, loaded through the layer's own loaders (head
padding, replicated KV heads, uneven MLP columns included):

- column parallel (qkv, gate/up): A replicated (every input column), B split by output
  rows exactly like W's rows; part ``p``'s B rows are zero outside that part's rows;
- row parallel (o, down): A split by input columns exactly like W's columns, B replicated;
  ``x_r A_r^T B^T`` is a partial sum like ``x_r W_r^T``, so the layer's one all-reduce (or
  reduce-scatter) sums both: no collective of its own.

A step multiplies every slot's A at once (one ``[T, S*P*R]`` product), zeroes each
token's columns of the other slots (``LoraBatch.token_slots``: -1 for the base model) and
adds the product with B to the layer's output: two products and a mask, static shapes
only, so CUDA graphs capture it. A rank below ``rank`` is zero-padded; an empty slot is
zero; PEFT's scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is folded into B.
"""

from __future__ import annotations

import torch
from torch import nn


class LoraBatch:
    """Which adapter slot each token of the running step is under.

    Invariants: ``token_slots`` (int64, device, ``max_tokens`` long) holds the step's
    tokens' slots in its first T entries and -1 (the base model) in every other entry, so a
    forward over a padded token count (sequence parallel, a CUDA graph's bucket) reads -1
    for the padding. ``active`` False: no token of the step is under an adapter and the
    layers skip the adapters' products (eager steps only; graphs are captured active)."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.active = False

    def set(self, slots: torch.Tensor | None, active: bool) -> None:
        """The step's per-token slots (None or empty: every token on the base model)."""
        self.token_slots.fill_(-1)
        if slots is not None and slots.numel():
            self.token_slots[: slots.shape[0]].copy_(slots)
        self.active = active


class LoraStack(nn.Module):
    """One layer's adapters (module docstring). ``rows`` and ``cols``: the layer's weight
    shard's shape on this rank; ``parts``: its ``checkpoint_parts()``."""

    def __init__(self, rows: int, cols: int, parts: tuple[object, ...], slots: int,
                 rank: int, dtype: torch.dtype, batch: LoraBatch):
        super().__init__()
        self.parts = parts
        self.rank = rank
        width = slots * len(parts) * rank
        self.a = nn.Parameter(torch.zeros(width, cols, dtype=dtype), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(rows, width, dtype=dtype), requires_grad=False)
        self.register_buffer("col_slot", torch.arange(slots).repeat_interleave(
            len(parts) * rank), persistent=False)
        self.batch = batch

    def columns(self, slot: int, part: object) -> slice:
        """The stacked rank columns of ``slot``'s ``part``."""
        start = (slot * len(self.parts) + self.parts.index(part)) * self.rank
        return slice(start, start + self.rank)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus every token's adapter delta (``x``: the layer's input on this rank)."""
        xa = x @ self.a.t()
        other = self.batch.token_slots[: x.shape[0], None] != self.col_slot
        return torch.addmm(y, xa.masked_fill(other, 0.0), self.b.t())


def lora_rows_loader(layer: nn.Module):
    """How ``layer`` shards a tensor of its checkpoint's output rows: B of a column-parallel
    layer (its ``weight_loader`` with a part's shard id), None for a row-parallel layer
    (every rank holds every output row)."""
    return None if hasattr(layer, "in_map") else layer.weight_loader


@torch.no_grad()
def load_lora(layer: nn.Module, slot: int, part: object, a: torch.Tensor, b: torch.Tensor,
              scale: float) -> None:
    """Puts one adapter's ``a [r, in]`` and ``b [out, r]`` (a checkpoint's, unsharded) for
    ``part`` of ``layer`` into ``slot``, this rank's shards of them, ``b`` times ``scale``."""
    stack: LoraStack = layer.lora
    r = a.shape[0]
    if b.shape[-1] != r or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make "
                         "one adapter (A [r, in], B [out, r])")
    if r > stack.rank:
        raise ValueError(f"rank {r} exceeds --max-lora-rank {stack.rank}")
    rows_loader = lora_rows_loader(layer)
    want = ((layer.weight.shape[0], layer.in_features) if rows_loader is None
            else (layer.checkpoint_rows(part), layer.weight.shape[1]))
    if (b.shape[0], a.shape[1]) != want:
        raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                         f"projection of shape {want} (out, in)")
    b = b.float() * scale
    if rows_loader is None:  # row parallel: A by input columns, B whole
        a_rank = torch.zeros(r, stack.a.shape[1], dtype=torch.float32, device=stack.a.device)
        layer.weight_loader(a_rank, a.float())
        b_rank = b
    else:  # column parallel: A whole, B by output rows
        a_rank = a.float()
        b_rank = torch.zeros(stack.b.shape[0], r, dtype=torch.float32, device=stack.b.device)
        rows_loader(b_rank, b, part)
    cols = stack.columns(slot, part)
    for param, value in ((stack.a, a_rank), (stack.b.t(), b_rank.t())):
        if tuple(value.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"an adapter tensor of shape {tuple(value.shape)} for a layer "
                             f"whose shard takes {tuple(param.shape[1:])}")
        block = param[cols]
        block.zero_()
        block[:r].copy_(value.to(param.dtype))

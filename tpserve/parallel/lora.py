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

The layer's weight and every slot's A share one tensor, ``w_ext = [W; A]`` (``weight``
and ``a`` are its two row ranges), so one product gives the layer's output and every
slot's ``x A^T`` together. A layer whose weight is stored quantized (GPTQ / AWQ integers:
any ``quant_method`` but ``UNQUANTIZED``) keeps its own product and ``a`` apart, in the
activations' dtype: one product more. Each token's columns of the other slots are zeroed by a mask
built once per step (``LoraBatch.mask``: -1 for the base model), and the product with B
is added to the output: one product and two small kernels more than the plain layer,
static shapes only, so CUDA graphs capture it. A rank below ``rank`` is zero-padded; an
empty slot is zero; PEFT's scale (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) is
folded into B.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.parallel.linear import UNQUANTIZED, RowParallelLinear


class LoraBatch:
    """Which adapter slot each token of the running step is under, and the masks the
    layers apply.

    Invariants, while ``active``: ``token_slots`` (int64, device, ``max_tokens`` long)
    holds the step's tokens' slots in its first T entries and -1 (the base model) in every
    other entry, so a forward over a padded token count (sequence parallel, a CUDA graph's
    bucket) reads -1 for the padding; ``masks[p]`` (``[max_tokens, slots * p * rank]``, the
    model's dtype) is 1 where a token's slot owns the column of a layer of ``p`` parts and
    0 elsewhere, rebuilt by every active ``set`` (static buffers: CUDA graphs read them).
    ``active`` False: no token of the step is under an adapter, the layers skip the
    adapters and nothing here is written (eager steps only; graphs are captured active)."""

    PARTS = (1, 2, 3)  # o/down, gate/up, q/k/v

    def __init__(self, max_tokens: int, slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.dtype, self.device = dtype, device  # the activations'
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.col_slots = {p: torch.arange(slots, device=device).repeat_interleave(p * rank)
                          for p in self.PARTS}
        self.masks = {p: torch.zeros(max_tokens, slots * p * rank, dtype=dtype, device=device)
                      for p in self.PARTS}
        self.active = False

    def set(self, slots: torch.Tensor | None, active: bool) -> None:
        """The step's per-token slots (None or empty: every token on the base model); an
        inactive step's are not written (no layer reads them)."""
        self.active = active
        if not active:
            return
        self.token_slots.fill_(-1)
        if slots is not None and slots.numel():
            self.token_slots[: slots.shape[0]].copy_(slots)
        for p, mask in self.masks.items():
            torch.eq(self.token_slots[:, None], self.col_slots[p], out=mask)

    def mask(self, parts: int, num_tokens: int) -> torch.Tensor:
        return self.masks[parts][:num_tokens]


class LoraStack(nn.Module):
    """One layer's adapters (module docstring), taking over an unquantized ``layer``'s
    weight (and bias) storage: ``layer.weight`` and ``a`` become the two row ranges of
    ``w_ext``, every value kept; beside a quantized layer's (``w_ext`` None, ``base``: its
    own product). ``parts``: the layer's ``checkpoint_parts()``."""

    def __init__(self, layer: nn.Module, slots: int, rank: int, batch: LoraBatch):
        super().__init__()
        self.parts = layer.checkpoint_parts()
        self.rank = rank
        self.batch = batch
        width = slots * len(self.parts) * rank
        if layer.quant_method is not UNQUANTIZED:
            self.rows = (layer.out_features if isinstance(layer, RowParallelLinear)
                         else layer.out_per_rank)
            cols = (layer.in_per_rank if isinstance(layer, RowParallelLinear)
                    else layer.in_features)
            self.w_ext = self.bias_ext = None
            # not a submodule: the layer owns this stack
            self.base = functools.partial(layer.quant_method.apply, layer)
            kw = dict(dtype=batch.dtype, device=batch.device)
            self.a = nn.Parameter(torch.zeros(width, cols, **kw), requires_grad=False)
            self.b = nn.Parameter(torch.zeros(self.rows, width, **kw), requires_grad=False)
            return
        w = layer.weight
        rows, cols = w.shape
        self.rows = rows
        with torch.no_grad():
            w_ext = torch.zeros(rows + width, cols, dtype=w.dtype, device=w.device)
            w_ext[:rows].copy_(w)
            self.bias_ext = None
            bias = getattr(layer, "bias", None)
            # a column-parallel layer's bias goes into the product (a row-parallel layer
            # adds its own after the reduction)
            if bias is not None and not isinstance(layer, RowParallelLinear):
                self.bias_ext = torch.zeros(rows + width, dtype=bias.dtype, device=w.device)
                self.bias_ext[:rows].copy_(bias)
                layer.bias = nn.Parameter(self.bias_ext[:rows], requires_grad=False)
        self.w_ext = w_ext  # not a parameter: ``layer.weight`` and ``a`` count its bytes
        layer.weight = nn.Parameter(w_ext[:rows], requires_grad=False)
        self.a = nn.Parameter(w_ext[rows:], requires_grad=False)
        self.b = nn.Parameter(torch.zeros(rows, width, dtype=w.dtype, device=w.device),
                              requires_grad=False)

    def columns(self, slot: int, part: object) -> slice:
        """The stacked rank columns of ``slot``'s ``part``."""
        start = (slot * len(self.parts) + self.parts.index(part)) * self.rank
        return slice(start, start + self.rank)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's ``x W^T (+ bias)`` plus every token's adapter delta (``x``: the
        layer's input on this rank)."""
        mask = self.batch.mask(len(self.parts), x.shape[0])
        if self.w_ext is None:  # a quantized layer: its own product, then the adapters'
            return torch.addmm(self.base(x, bias), F.linear(x, self.a) * mask, self.b.t())
        out = F.linear(x, self.w_ext, None if bias is None else self.bias_ext)
        return torch.addmm(out[:, :self.rows], out[:, self.rows:] * mask, self.b.t())


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
    row_parallel = isinstance(layer, RowParallelLinear)
    want = ((stack.rows, layer.in_features) if row_parallel
            else (layer.checkpoint_rows(part), stack.a.shape[1]))
    if (b.shape[0], a.shape[1]) != want:
        raise ValueError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                         f"projection of shape {want} (out, in)")
    b = b.float() * scale
    if row_parallel:  # A by input columns (the weight's loader), B whole
        a_rank = torch.zeros(r, stack.a.shape[1], dtype=torch.float32, device=stack.a.device)
        layer.weight_loader(a_rank, a.float())
        b_rank = b
    else:  # column parallel: A whole, B by output rows (the weight's loader, part by part)
        a_rank = a.float()
        b_rank = torch.zeros(stack.b.shape[0], r, dtype=torch.float32, device=stack.b.device)
        layer.weight_loader(b_rank, b, part)
    cols = stack.columns(slot, part)
    for param, value in ((stack.a, a_rank), (stack.b.t(), b_rank.t())):
        if tuple(value.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"an adapter tensor of shape {tuple(value.shape)} for a layer "
                             f"whose shard takes {tuple(param.shape[1:])}")
        block = param[cols]
        block.zero_()
        block[:r].copy_(value.to(param.dtype))

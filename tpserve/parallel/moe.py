"""A mixture of experts' expert MLPs, tensor-parallel: every rank holds every expert, each
expert's intermediate columns split over ranks as a dense MLP's are (``ShardMap.contiguous``),
zero-padded where tp does not divide and up to a multiple of ``WIDTH_ALIGN`` (a padded
column adds nothing). ``forward`` returns this rank's partial sums; the caller reduces them
(``Communicator``), once, with whatever else it adds first.

The experts run as two grouped matrix products over the routed copies of the tokens sorted
by expert (the ops' ``grouped_mm``: one group per expert, its rows given by device offsets;
``torch._grouped_mm`` or a Triton kernel), so a step's shapes depend only on its token
count: no host synchronisation, capturable in a CUDA graph, the same code on CPU and on the
GPU (its test oracle is a loop over experts in float64, ``tests/parallel/test_moe_experts.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpserve.parallel.comm import Communicator
from tpserve.parallel.shard import (
    InMemorySource,
    NarrowSource,
    ShardMap,
    TensorSource,
    as_source,
    padded_split,
)

# rows grouped by expert, each expert's [N, K] weights, the groups' row ends, each expert's
# [N] output scales (None: none) -> the products
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                     torch.Tensor]
# the parts of one expert's gated MLP as checkpoints store them
GATE, UP, DOWN = "gate", "up", "down"
# the grouped product needs rows whose strides are multiples of 16 bytes: each rank's
# expert width is padded to a multiple of 8 columns (zero columns, as tp's padding)
WIDTH_ALIGN = 8


def expert_range(num_experts: int, tp: int, rank: int) -> tuple[int, int]:
    """Expert parallel: ``(first, count)`` of ``rank``'s experts, the ``E mod tp`` first
    ranks holding one more than the others."""
    base, extra = divmod(num_experts, tp)
    return rank * base + min(rank, extra), base + (rank < extra)


def expert_width_per_rank(intermediate: int, tp: int) -> int:
    """Each rank's columns of an expert ``intermediate`` wide: ``ceil(intermediate / tp)``
    rounded up to ``WIDTH_ALIGN``."""
    return -(-padded_split(intermediate, tp) // WIDTH_ALIGN) * WIDTH_ALIGN


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ParallelExperts(nn.Module):
    """``num_experts`` gated MLPs ``act(x G_e^T) * (x U_e^T)`` then ``D_e``: ``w13``
    ``[E, 2 I_r, H]`` (each expert's gate rows, then its up rows, of this rank's ``I_r``
    columns) and ``w2`` ``[E, H, I_r]``, both loaded expert by expert through
    ``weight_loader`` with a ``(expert, part)`` shard id.

    ``quant_method`` (duck-typed, as the linear layers'; None: unquantized): its
    ``process_experts(experts)``, called after loading (``process_weights_after_loading``),
    may replace ``w13`` / ``w2`` by quantized codes and set ``w13_scale`` / ``w2_scale``
    (``[E, rows]`` float32, one per output row), which the grouped products then apply.

    ``expert_parallel`` (``--enable-expert-parallel``): each rank holds a contiguous range
    of whole experts instead (``expert_range``: E / tp each, the first E mod tp ranks one
    more): it runs the routed copies of the tokens that chose them and returns zero for
    the others, so the caller's one reduction sums the experts as it sums the column
    shards otherwise. Fewer, wider products per rank; the load is as balanced as the
    routing."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, comm: Communicator,
                 dtype: torch.dtype | None = None, quant_method=None,
                 expert_parallel: bool = False):
        super().__init__()
        self.comm = comm
        self.quant_method = quant_method
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel and comm.world_size > 1
        tp, rank = (1, 0) if self.expert_parallel else (comm.world_size, comm.rank)
        if self.expert_parallel and num_experts < comm.world_size:
            raise ValueError(f"--enable-expert-parallel: {num_experts} experts for "
                             f"{comm.world_size} ranks (each rank needs one at least)")
        # this rank's experts: [first, first + local)
        self.first, self.local = (expert_range(num_experts, comm.world_size, comm.rank)
                                  if self.expert_parallel else (0, num_experts))
        split = ShardMap.contiguous(intermediate, tp, rank)
        self.in_map = ShardMap(expert_width_per_rank(intermediate, tp), split.runs)
        width = self.in_map.numel
        self.w13 = _param((self.local, 2 * width, hidden), dtype)
        self.w2 = _param((self.local, hidden, width), dtype)
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """One expert's checkpoint tensor: its gate or up ``[I, H]`` (this rank's rows into
        ``w13``) or its down ``[H, I]`` (this rank's columns into ``w2``); another rank's
        expert (expert parallel) is not read."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a model with {self.num_experts} experts")
        expert -= self.first
        if not 0 <= expert < self.local:
            return
        src = as_source(source)
        if part == DOWN:
            self.in_map.load(self.w2[expert], src, 1, "expert down weight")
            return
        if part not in (GATE, UP):
            raise ValueError(f"unknown expert part {part!r}")
        width = self.in_map.numel
        dest = self.w13[expert].narrow(0, 0 if part == GATE else width, width)
        self.in_map.load(dest, src, 0, f"expert {part} weight")

    def load_stacked(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                     part: str | None = None) -> None:
        """Every expert's ``part`` in one tensor, stacked along dim 0, read one expert at a
        time: ``GATE`` or ``UP`` ``[E, I, H]`` into ``w13`` (llama.cpp's ``ffn_gate_exps``,
        ``ffn_up_exps``), ``DOWN`` ``[E, H, I]`` into ``w2``; None: transformers 5's
        ``gate_up_proj`` ``[E, 2 I, H]`` (each expert's gate rows, then its up rows) into
        ``w13``, or its ``down_proj`` into ``w2``."""
        src = as_source(source)
        if len(src.shape) != 3 or src.shape[0] != self.num_experts:
            raise ValueError(f"stacked experts of shape {tuple(src.shape)}; expected "
                             f"[{self.num_experts}, rows, columns]")
        for e in range(self.first, self.first + self.local):
            expert = InMemorySource(src.read(0, e, 1)[0])
            if param is self.w2 or part is not None:
                self.weight_loader(param, expert, (e, DOWN if param is self.w2 else part))
                continue
            rows = expert.shape[0] // 2
            self.weight_loader(param, NarrowSource(expert, 0, 0, rows), (e, GATE))
            self.weight_loader(param, NarrowSource(expert, 0, rows, rows), (e, UP))

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_experts(self)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                grouped_mm: GroupedMM) -> torch.Tensor:
        """``sum_j w[t, j] expert_{ids[t, j]}(x[t])`` over this rank's columns: ``x``
        ``[T, H]``, ``topk_ids`` / ``topk_weights`` ``[T, k]`` (weights in any float dtype;
        the weighted sum is taken in ``x``'s dtype, accumulated as the matrix product
        accumulates); ``act_and_mul`` maps ``[rows, 2 I_r]`` = ``[gate | up]`` to
        ``[rows, I_r]``; ``grouped_mm(rows, w, ends, scale)`` multiplies rows grouped by
        expert (group e's end at ``ends[e]``) by each expert's ``w[e]`` transposed, each
        output column times ``scale[e]``'s entry where given (the ops' ``grouped_mm``:
        ``torch._grouped_mm``, or a Triton kernel)."""
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        mine = None
        if self.expert_parallel:  # other ranks' experts: one group past this rank's own
            flat = flat - self.first
            mine = (flat >= 0) & (flat < self.local)
            flat = torch.where(mine, flat, self.local)
        order = torch.argsort(flat, stable=True)  # routed copies, grouped by expert
        counts = torch.zeros(self.local + 1, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        # group e's rows end at ends[e]; rows past the last (other ranks') are not computed
        ends = counts[:self.local].cumsum(0, dtype=torch.int32)
        rows = x.index_select(0, order // k)
        h = act_and_mul(grouped_mm(rows, self.w13, ends, self.w13_scale))
        y = grouped_mm(h, self.w2, ends, self.w2_scale)
        per_copy = torch.empty_like(y).index_copy_(0, order, y)  # back in (token, j) order
        if mine is not None:  # whatever the uncomputed rows hold: zero
            per_copy = torch.where(mine.unsqueeze(1), per_copy, 0)
        weights = topk_weights.to(x.dtype).unsqueeze(1)  # [T, 1, k]
        return torch.bmm(weights, per_copy.view(t, k, -1)).squeeze(1)


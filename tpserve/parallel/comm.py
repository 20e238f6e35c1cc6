"""The communicator: the only place collectives happen. Every call is a no-op at tp 1; at
tp > 1 each one is a named NVTX range when ``--nvtx`` is on (``parallel/nvtx.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpserve.parallel.nvtx import OFF, Ranges
from tpserve.parallel.p2p_all_reduce import P2PAllReduce
from tpserve.parallel.state import TPGroup

# How the residual stream travels between tensor-parallel layers (``--tp-comm``):
# "allreduce": every rank holds every token; row-parallel layers end in an all-reduce.
# "allgather": sequence parallel; each rank holds 1/tp of the tokens between layers,
#   column-parallel layers are fed by an all-gather of the tokens and row-parallel layers
#   end in a reduce-scatter over tokens (the same bytes as one all-reduce, split in two).
TP_COMM_MODES = ("allreduce", "allgather")


class Communicator:
    """All-reduce, all-gather, reduce-scatter and broadcast over the tensor-parallel group.

    Layers call these explicitly in ``forward()``; nothing is hidden in hooks. With ``p2p``
    (GPUs of one host), small all-reduces go over peer-to-peer memory instead of NCCL.
    """

    def __init__(self, group: TPGroup, p2p: P2PAllReduce | None = None,
                 ranges: Ranges = OFF):
        self.group = group
        self.ranges = ranges
        self.rank = group.rank
        self.world_size = group.world_size
        self.p2p = p2p
        # gloo has no reduce-scatter: all-reduce, then keep this rank's slice
        self.native_reduce_scatter = (group.group is not None
                                      and dist.get_backend(group.group) != "gloo")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over ranks: ``x`` itself, summed in place (NCCL, gloo, tp 1), or a
        new tensor (the peer-to-peer path); callers use the returned tensor."""
        if self.world_size == 1:
            return x
        with self.ranges.range("all_reduce"):
            if self.p2p is not None and self.p2p.handles(x):
                return self.p2p.all_reduce(x)
            dist.all_reduce(x, group=self.group.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``x`` along ``dim`` (rank order)."""
        if self.world_size == 1:
            return x
        with self.ranges.range("all_gather"):
            x = x.contiguous()
            flat = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                               device=x.device)
            dist.all_gather_into_tensor(flat, x, group=self.group.group)
        dim = dim % x.dim()
        if dim == 0:
            return flat
        return torch.cat(flat.view(self.world_size, *x.shape).unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over ranks and returns this rank's slice of rows: rows
        ``[rank*n, (rank+1)*n)`` with ``n = x.shape[0] / world_size`` (which must divide)."""
        if self.world_size == 1:
            return x
        n = x.shape[0] // self.world_size
        if n * self.world_size != x.shape[0]:
            raise ValueError(f"reduce_scatter of {x.shape[0]} rows over {self.world_size} "
                             "ranks: the rows must divide evenly")
        if not self.native_reduce_scatter:
            return self.all_reduce(x).narrow(0, self.rank * n, n)
        with self.ranges.range("reduce_scatter"):
            out = torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copies rank ``src``'s ``x`` into every rank's ``x`` (same shape and dtype)."""
        if self.world_size > 1:
            with self.ranges.range("broadcast"):
                dist.broadcast(x, src=src, group=self.group.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum over ranks, in place (used to agree on memory plans)."""
        if self.world_size > 1:
            with self.ranges.range("all_reduce_min"):
                dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group.group)
        return x

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a minimum all-reduce of one flag): how the
        ranks agree that a step every rank took (a sleep, a wake-up, a reload) is kept."""
        flag = torch.tensor([int(ok)], dtype=torch.int64, device=self.group.device)
        return bool(int(self.all_reduce_min(flag).item()))

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks, in place (used to agree on KV cache scales)."""
        if self.world_size > 1:
            with self.ranges.range("all_reduce_max"):
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group.group)
        return x

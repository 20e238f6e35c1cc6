"""The communicator: the only place collectives happen. Every call is a no-op at tp 1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpserve.parallel.state import TPGroup


class Communicator:
    """All-reduce, all-gather and broadcast over the tensor-parallel group.

    Layers call these explicitly in ``forward()``; nothing is hidden in hooks.
    """

    def __init__(self, group: TPGroup):
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's ``x`` along ``dim`` (rank order)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        flat = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                           device=x.device)
        dist.all_gather_into_tensor(flat, x, group=self.group.group)
        dim = dim % x.dim()
        if dim == 0:
            return flat
        return torch.cat(flat.view(self.world_size, *x.shape).unbind(0), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copies rank ``src``'s ``x`` into every rank's ``x`` (same shape and dtype)."""
        if self.world_size > 1:
            dist.broadcast(x, src=src, group=self.group.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise minimum over ranks, in place (used to agree on memory plans)."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group.group)
        return x

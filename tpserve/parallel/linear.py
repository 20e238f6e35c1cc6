"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that narrows the
checkpoint tensor to this rank's shard.

Weights follow torch's ``[out_features, in_features]`` layout:
- column parallel splits ``out_features`` (dim 0); ``gather_output`` all-gathers the shards;
- row parallel splits ``in_features`` (dim 1) and all-reduces the partial sums; the bias is
  added once, after the reduction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.parallel.comm import Communicator
from tpserve.parallel.shard import TensorSource, as_source, copy_into, split_evenly


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over ranks.

    Rank r holds rows ``[r*out/tp, (r+1)*out/tp)``. With ``gather_output`` the shards are
    all-gathered so every rank returns the full output; otherwise each returns its shard.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 bias: bool = False, gather_output: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self._init_shard(in_features,
                         split_evenly(out_features, comm.world_size, "output features"),
                         comm, bias, gather_output, dtype)

    def _init_shard(self, in_features: int, out_per_rank: int, comm: Communicator,
                    bias: bool, gather_output: bool, dtype: torch.dtype | None) -> None:
        """This rank's ``[out_per_rank, in_features]`` weight (and bias), each loaded by
        ``weight_loader``."""
        self.comm = comm
        self.gather_output = gather_output
        self.out_per_rank = out_per_rank
        self.weight = _param((out_per_rank, in_features), dtype)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param((out_per_rank,), dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        src = as_source(source)
        start = self.comm.rank * self.out_per_rank
        copy_into(param, src.read(0, start, self.out_per_rank), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up).

    Each rank's weight is the concatenation of its shard of every part, in part order;
    ``shard_id`` (the part index) tells the loader where a checkpoint tensor goes.
    """

    def __init__(self, in_features: int, out_sizes: list[int], comm: Communicator,
                 bias: bool = False, dtype: torch.dtype | None = None):
        self.part_per_rank = [split_evenly(s, comm.world_size, "output features")
                              for s in out_sizes]
        super().__init__(in_features, sum(out_sizes), comm, bias, False, dtype)

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        src = as_source(source)
        idx = int(shard_id)
        size = self.part_per_rank[idx]
        offset = sum(self.part_per_rank[:idx])
        copy_into(param.narrow(0, offset, size),
                  src.read(0, self.comm.rank * size, size), f"merged part {idx}")


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split by attention heads.

    Rank r holds query heads ``[r*Hq/tp, (r+1)*Hq/tp)``. KV heads are split the same way
    when ``Hkv >= tp``; when ``tp > Hkv`` each KV head is replicated on ``tp / Hkv``
    consecutive ranks (rank r holds KV head ``r // (tp / Hkv)``), so every rank keeps the
    KV head its query heads attend to.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 comm: Communicator, bias: bool = False, dtype: torch.dtype | None = None):
        tp = comm.world_size
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = split_evenly(num_kv_heads, tp, "number of KV heads")
            self.kv_head_start = comm.rank * self.num_kv_heads
        else:
            replicas = split_evenly(tp, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
            self.kv_head_start = comm.rank // replicas
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.sizes = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        nn.Module.__init__(self)  # sizes are per head, not an even split of the output
        self._init_shard(hidden, q + 2 * kv, comm, bias, False, dtype)

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        src = as_source(source)
        offset, size = self.sizes[str(shard_id)]
        head0 = (self.comm.rank * self.num_heads if shard_id == "q" else self.kv_head_start)
        copy_into(param.narrow(0, offset, size), src.read(0, head0 * self.head_dim, size),
                  f"{shard_id}_proj shard")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q+2kv] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]`` (this rank's heads)."""
        q, k, v = qkv.split([self.sizes["q"][1], self.sizes["k"][1], self.sizes["v"][1]], -1)
        d = self.head_dim
        return (q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d),
                v.reshape(-1, self.num_kv_heads, d))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over ranks; the input is the matching
    shard of ``x`` (as produced by a column-parallel layer). Partial sums are all-reduced,
    then the (unsharded) bias is added once.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.comm = comm
        self.in_per_rank = split_evenly(in_features, comm.world_size, "input features")
        self.weight = _param((out_features, self.in_per_rank), dtype)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param((out_features,), dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        src = as_source(source)
        start = self.comm.rank * self.in_per_rank
        copy_into(param, src.read(1, start, self.in_per_rank), "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                    shard_id: object = None) -> None:
        copy_into(param, as_source(source).read(), "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

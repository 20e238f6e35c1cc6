"""Vocab-parallel embedding and LM head: the vocabulary is split in contiguous ranges.

Rank r owns token ids ``[r*P, min((r+1)*P, V))`` with ``P = ceil(V / tp)``; its weight has
P rows, rows past V are zero padding (only the last rank can have them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.parallel.comm import Communicator
from tpserve.parallel.shard import TensorSource, as_source, copy_into


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its range (zeros elsewhere); an all-reduce sums them
    (``reduce="all_reduce"``), or a reduce-scatter over tokens leaves each rank its
    ``T/tp`` rows (``"reduce_scatter"``: sequence parallel; T must divide by tp)."""

    def __init__(self, vocab_size: int, hidden: int, comm: Communicator,
                 dtype: torch.dtype | None = None, reduce: str = "all_reduce"):
        super().__init__()
        if reduce not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"unknown reduce {reduce!r}")
        self.comm = comm
        self.reduce = reduce
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // comm.world_size)
        self.start = comm.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        n = max(self.end - self.start, 0)
        with torch.no_grad():
            param[n:].zero_()
        if n:
            copy_into(param[:n], as_source(source).read(0, self.start, n), "embedding shard")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(ids, self.weight)  # (a reduce-scatter over 1 rank is a no-op)
        inside = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * inside, self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        if self.reduce == "all_reduce":
            return self.comm.all_reduce(out)
        return self.comm.reduce_scatter(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary range, all-gathered into the full vocabulary.

    Sharded exactly like ``VocabParallelEmbedding``, so tied embeddings share one weight.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return self.comm.all_gather(logits, dim=-1)[..., : self.vocab_size]

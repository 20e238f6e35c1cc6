"""How attention heads are laid out over tensor-parallel ranks, with zero heads as padding
where the head counts do not divide by tp.

Scheme (``HeadLayout.plan``): KV heads are padded to ``Hkv'``, the smallest count
``>= Hkv`` that tp divides or that divides tp (when ``tp > Hkv'`` each KV head is
replicated on ``tp / Hkv'`` consecutive ranks). Each KV head's group of ``g = Hq / Hkv``
query heads is padded to ``g'``, the smallest ``>= g`` with ``Hkv' * g'`` divisible by tp.
Padded query head ``j`` belongs to padded KV head ``j // g'``, so every rank holds the KV
heads its query heads use (GQA grouping is kept).

Why the function is unchanged: padded q/k/v rows are zero, and so are the o_proj input
columns of every padded query head, so a padded head contributes nothing (even though a
zero query attends uniformly and may read real values).
"""

from __future__ import annotations

from dataclasses import dataclass

from tpserve.parallel.shard import ShardMap


@dataclass(frozen=True)
class HeadLayout:
    num_heads: int         # query heads in the checkpoint (Hq)
    num_kv_heads: int      # KV heads in the checkpoint (Hkv)
    tp: int
    padded_kv_heads: int   # Hkv'
    group: int             # g': query heads per (padded) KV head

    @classmethod
    def plan(cls, num_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
        if tp < 1:
            raise ValueError(f"the tensor-parallel size must be >= 1, got {tp}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not form groups over "
                             f"{num_kv_heads} KV heads")
        kv = num_kv_heads
        while kv % tp and tp % kv:
            kv += 1
        g = num_heads // num_kv_heads
        while (kv * g) % tp:
            g += 1
        return cls(num_heads, num_kv_heads, tp, kv, g)

    @property
    def padded_heads(self) -> int:
        """Hq' = Hkv' * g'."""
        return self.padded_kv_heads * self.group

    @property
    def heads_per_rank(self) -> int:
        return self.padded_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds (a replicated head counts once per rank)."""
        return max(self.padded_kv_heads // self.tp, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold each KV head (1 unless ``tp > Hkv'``)."""
        return max(self.tp // self.padded_kv_heads, 1)

    @property
    def padded(self) -> bool:
        return (self.padded_heads, self.padded_kv_heads) != (self.num_heads, self.num_kv_heads)

    def kv_head_start(self, rank: int) -> int:
        """The first (padded) KV head of ``rank``."""
        return rank // self.kv_replicas * self.kv_heads_per_rank

    def q_sources(self, rank: int) -> list[int | None]:
        """Checkpoint query head of each of ``rank``'s query heads (None: padding)."""
        g, g_pad = self.num_heads // self.num_kv_heads, self.group
        out: list[int | None] = []
        for j in range(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank):
            kv, i = divmod(j, g_pad)
            out.append(kv * g + i if kv < self.num_kv_heads and i < g else None)
        return out

    def kv_sources(self, rank: int) -> list[int | None]:
        """Checkpoint KV head of each of ``rank``'s KV heads (None: padding)."""
        start = self.kv_head_start(rank)
        return [h if h < self.num_kv_heads else None
                for h in range(start, start + self.kv_heads_per_rank)]

    def q_map(self, rank: int, head_dim: int) -> ShardMap:
        return ShardMap.from_sources(self.q_sources(rank), head_dim)

    def kv_map(self, rank: int, head_dim: int) -> ShardMap:
        return ShardMap.from_sources(self.kv_sources(rank), head_dim)

    def describe(self) -> str:
        """One line: the padding and what it costs each rank."""
        if not self.padded:
            return f"tp {self.tp}: no head padding"
        q = self.padded_heads / self.num_heads - 1
        kv = self.padded_kv_heads / self.num_kv_heads - 1
        cost = (f"+{q:.0%} attention FLOPs and KV cache per rank" if abs(q - kv) < 1e-9
                else f"+{q:.0%} attention FLOPs, +{kv:.0%} KV cache per rank")
        return (f"tp {self.tp}: padding {self.num_heads} q heads -> {self.padded_heads}, "
                f"{self.num_kv_heads} KV heads -> {self.padded_kv_heads} ({cost})")

"""Lazy checkpoint tensors: a layer reads only its own shard, never the full weight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in part.

    ``read(dim, start, length)`` returns the slice ``[start, start+length)`` along ``dim``
    (the whole tensor when ``dim`` is None), materialised as a torch tensor.
    """

    shape: tuple[int, ...]

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor: ...


class InMemorySource:
    """A ``TensorSource`` over a tensor that is already in memory (tests, dummy weights)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self.tensor
        length = self.shape[dim] - start if length is None else length
        return self.tensor.narrow(dim, start, length)


def as_source(x: torch.Tensor | TensorSource) -> TensorSource:
    return InMemorySource(x) if isinstance(x, torch.Tensor) else x


class NarrowSource:
    """Units ``[start, start+length)`` of ``source`` along ``dim`` as a ``TensorSource`` of
    their own: one part of a checkpoint tensor that stores several parts stacked (Phi-3's
    fused ``qkv_proj``: the q, k and v rows), handed to a loader that expects that part
    alone.

    A read along ``dim`` is one read of the parent at an offset, so a rank still reads only
    its own rows of the part. A read along another dim reads that range of the parent over
    its whole extent along ``dim``, then narrows it (column-parallel layers, which alone
    take fused parts, read along dim 0). Reads past the part are refused: the parent would
    silently return the next part's rows.
    """

    def __init__(self, source: TensorSource, dim: int, start: int, length: int):
        dim %= len(source.shape)
        if start < 0 or length < 0 or start + length > source.shape[dim]:
            raise ValueError(f"units [{start}, {start + length}) of dim {dim} lie outside a "
                             f"tensor of shape {tuple(source.shape)}")
        self.source, self.dim, self.start, self.length = source, dim, start, length
        self.shape = tuple(length if d == dim else n for d, n in enumerate(source.shape))

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self.source.read(self.dim, self.start, self.length)
        dim %= len(self.shape)
        length = self.shape[dim] - start if length is None else length
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"units [{start}, {start + length}) of dim {dim} lie outside a "
                             f"tensor part of shape {self.shape}")
        if dim == self.dim:
            return self.source.read(dim, self.start + start, length)
        return self.source.read(dim, start, length).narrow(self.dim, self.start, self.length)


def split_evenly(total: int, parts: int, what: str) -> int:
    """``total // parts``, or a clear error when ``parts`` does not divide ``total``."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                         f"({parts})")
    return total // parts


def padded_split(total: int, parts: int) -> int:
    """``ceil(total / parts)``: the per-rank size when the remainder is zero padding."""
    return -(-total // parts)


@dataclass(frozen=True)
class ShardMap:
    """Which checkpoint units one rank holds along one dimension, with zero padding.

    A unit is ``unit`` consecutive rows (or columns): one attention head, or one row. The
    rank's dimension has ``size`` units; ``runs`` lists ``(local, source, length)``: local
    units ``[local, local+length)`` are checkpoint units ``[source, source+length)``. Local
    units in no run are padding and load as zeros. Each run is one ``read``, so a rank
    never materialises more of the checkpoint tensor than its own units.
    """

    size: int
    runs: tuple[tuple[int, int, int], ...]
    unit: int = 1

    @classmethod
    def from_sources(cls, sources: Sequence[int | None], unit: int = 1) -> ShardMap:
        """``sources[i]`` is the checkpoint unit of local unit ``i`` (None: padding)."""
        runs: list[tuple[int, int, int]] = []
        for i, src in enumerate(sources):
            if src is None:
                continue
            if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == src:
                local, first, n = runs[-1]
                runs[-1] = (local, first, n + 1)
            else:
                runs.append((i, src, 1))
        return cls(len(sources), tuple(runs), unit)

    @classmethod
    def contiguous(cls, total: int, parts: int, rank: int, unit: int = 1) -> ShardMap:
        """Rank ``rank``'s ``ceil(total / parts)`` units; units past ``total`` are padding
        (only the last ranks can have them)."""
        per = padded_split(total, parts)
        start = rank * per
        n = max(min(per, total - start), 0)
        return cls(per, ((0, start, n),) if n else (), unit)

    @property
    def numel(self) -> int:
        """Rows (or columns) this rank holds: ``size * unit``."""
        return self.size * self.unit

    @property
    def padded(self) -> bool:
        return sum(n for _, _, n in self.runs) < self.size

    def load(self, dest: torch.Tensor, source: TensorSource, dim: int, name: str,
             fill: float = 0.0) -> None:
        """Fills ``dest`` (``numel`` long along ``dim``) from ``source``; padding is ``fill``
        (zero, except for tensors such as scales whose padding rows need another value)."""
        u = self.unit
        if self.padded:
            with torch.no_grad():
                dest.fill_(fill)
        for local, src, n in self.runs:
            copy_into(dest.narrow(dim, local * u, n * u), source.read(dim, src * u, n * u),
                      name)


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype))

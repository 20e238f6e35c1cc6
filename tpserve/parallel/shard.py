"""Lazy checkpoint tensors: a layer reads only its own shard, never the full weight."""

from __future__ import annotations

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


def split_evenly(total: int, parts: int, what: str) -> int:
    """``total // parts``, or a clear error when ``parts`` does not divide ``total``."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                         f"({parts})")
    return total // parts


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(dtype=param.dtype))

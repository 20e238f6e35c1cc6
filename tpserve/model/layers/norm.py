"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.kernels.backend import Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops: Ops, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

"""RMSNorm, optionally fused with the residual add and with the per-token fp8
quantization of its output (for a W8A8 layer: ``quant.fp8.Fp8Activation``)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.kernels.backend import Ops
from tpserve.model.quant.fp8 import Fp8Activation


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops: Ops, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize: bool = False):
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given;
        with ``quantize`` the normed rows come as an ``Fp8Activation`` (the same values,
        quantized per token in the same kernel)."""
        if quantize:
            if residual is None:
                return Fp8Activation(*self.ops.rms_norm_fp8(x, self.weight, self.eps))
            q, s, dtype, summed = self.ops.add_rms_norm_fp8(x, residual, self.weight,
                                                            self.eps)
            return Fp8Activation(q, s, dtype), summed
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

"""RMSNorm, optionally fused with the residual add and with the per-token fp8
quantization of its output (for a W8A8 layer: ``quant.fp8.Fp8Activation``)."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.kernels.backend import Ops
from tpserve.model.kernels.torch_ops import holds_sum
from tpserve.model.quant.fp8 import Fp8Activation
from tpserve.parallel.linear import InputQuantization


class RMSNorm(nn.Module):
    """``unit_offset`` (Gemma): the weight is stored as the checkpoint's ``w`` and scales by
    ``1 + w`` in float32 (``torch_ops.rms_norm``); such a norm never quantizes its output
    (a W8A8 layer after it quantizes its own input)."""

    def __init__(self, hidden: int, eps: float, ops: Ops, dtype: torch.dtype | None = None,
                 unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.unit_offset = unit_offset
        self.weight = nn.Parameter((torch.zeros if unit_offset else torch.ones)(
            hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize: InputQuantization | None = None):
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given;
        with ``quantize`` (the consuming layer's ``input_quantization``) the normed rows
        come as an ``Fp8Activation`` (the same values, quantized in the same kernel: per
        token, with the layer's static input scale, or per group of a block-wise layer's
        columns).

        The residual is consumed: where it can hold the sum (contiguous, of the sum's
        dtype) the sum is written over it and it is returned, so the residual stream of a
        step lives in one buffer instead of a new one per norm (in an eager 8,192-token
        step each was 64 MiB, and one of them split the cached block the next gate/up
        output needed: bench/README.md round 17). Callers must not read ``residual``
        afterwards except through the returned sum."""
        if self.unit_offset and quantize is not None:
            raise ValueError("a unit-offset (Gemma) norm does not quantize its output")
        if residual is None:
            if quantize is not None:
                return Fp8Activation(*self.ops.rms_norm_fp8(x, self.weight, self.eps,
                                                            *quantize))
            return self.ops.rms_norm(x, self.weight, self.eps, self.unit_offset)
        sum_out = residual if holds_sum(residual, x, residual) else None
        if quantize is not None:
            q, s, dtype, summed = self.ops.add_rms_norm_fp8(x, residual, self.weight,
                                                            self.eps, sum_out, *quantize)
            return Fp8Activation(q, s, dtype), summed
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, sum_out,
                                     self.unit_offset)

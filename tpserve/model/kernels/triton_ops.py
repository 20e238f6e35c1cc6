"""Triton ops for the CUDA path: the norms and the activation (and their fp8-quantizing
variants) and a mixture of experts' grouped product, with the same signatures and semantics
as torch_ops (the ``Ops`` bundle). Each op lives in its own ``triton_*`` module; the
attention kernels are composed by ``attention.triton_backend``."""

from __future__ import annotations

from tpserve.model.kernels.triton_activation import gelu_tanh_and_mul, silu_and_mul
from tpserve.model.kernels.triton_fp8_fused import (
    add_rms_norm_fp8,
    rms_norm_fp8,
    silu_and_mul_fp8,
)
from tpserve.model.kernels.triton_moe import grouped_mm
from tpserve.model.kernels.triton_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_fp8", "gelu_tanh_and_mul", "grouped_mm", "rms_norm",
           "rms_norm_fp8", "silu_and_mul", "silu_and_mul_fp8"]

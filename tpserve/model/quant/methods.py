"""``--quantization`` -> the linear layers' ``quant_method`` (see ``parallel/linear.py``),
chosen once when the model is built."""

from __future__ import annotations

import torch

from tpserve.model.quant.fp8 import Fp8LinearMethod, scaled_mm_supported

QUANTIZATIONS = ("none", "fp8")


def linear_method(quantization: str, kernel_backend: str, device: torch.device,
                  dtype: torch.dtype, weight_only_max_tokens: int) -> Fp8LinearMethod | None:
    """None (the layers' default, unquantized) or the method for ``quantization``; the
    Triton kernels with the Triton kernel back-end, the torch reference otherwise."""
    if quantization == "none":
        return None
    if quantization != "fp8":
        raise ValueError(f"unknown --quantization {quantization!r}; choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    return Fp8LinearMethod(
        backend="triton" if kernel_backend == "triton" else "torch",
        weight_only_max_tokens=weight_only_max_tokens,
        scaled_mm=scaled_mm_supported(device) and dtype == torch.bfloat16)

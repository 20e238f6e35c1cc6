"""Launch-side helpers shared by the Triton kernels: dtype mapping and matmul operand policy.

Triton kernels in this package always accumulate in float32. Matmuls (``tl.dot``) take their
operands in a *dot dtype* chosen here on the host and passed as a ``tl.constexpr``:

- fp16 / bf16 inputs on CUDA: the input dtype itself (tensor cores, fp32 accumulation);
- fp32 inputs: float32 with ``input_precision="ieee"`` (no silent TF32, so results match
  the torch reference);
- bf16 inputs off CUDA (the ``TRITON_INTERPRET=1`` CPU interpreter): float32. The
  interpreter stores bf16 as raw ``uint16`` and its ``tl.dot`` multiplies those integers, so
  kernels round operands to bf16 first and widen them; products of bf16 values are exact in
  fp32, so this matches what a bf16 MMA with fp32 accumulation computes on the GPU.
"""

from __future__ import annotations

import torch
import triton.language as tl

# Every launch passes ``enable_fp_fusion=FP_FUSION``: multiply-adds fused, Triton's default
# through 3.9, which warns when it is left unset, and which 3.10 turns off. The kernels'
# numerics are stated for it (a float32 product of 16-bit values is exact, so fusing it
# into an add rounds as the torch reference does; float32 scales are rounded on their own,
# ``triton_wna16_codes._dequant``), and the GEMVs' sums are one instruction a weight.
FP_FUSION = True

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton element type of a supported torch floating dtype."""
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype for Triton kernels: {dtype}")
    return _TL_DTYPES[dtype]


def dot_config(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """``(dot operand dtype, input_precision)`` for matmuls over inputs of ``dtype``."""
    tdt = tl_dtype(dtype)
    if dtype == torch.float32 or (dtype == torch.bfloat16 and device.type != "cuda"):
        return tl.float32, "ieee"
    return tdt, "tf32"  # the precision only applies to fp32 operands; ignored for fp16/bf16


def check_head_dim(head_dim: int) -> None:
    """Attention kernels tile the whole head dimension at once, padded to a power of two
    (the pad masked: Phi-3-mini's 96 tiles as 128): a multiple of 8 of at least 16."""
    assert head_dim >= 16 and head_dim % 8 == 0, (
        f"head_dim must be a multiple of 8 of at least 16, got {head_dim}")

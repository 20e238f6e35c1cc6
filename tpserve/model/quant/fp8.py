"""FP8 (e4m3) linear layers: weights quantized per output channel at load, activations per
token at run time, the product through ``torch._scaled_mm`` on Hopper-class GPUs.

Invariant: ``x ~= q * scale`` row by row, with each row's largest magnitude mapped to the
largest finite e4m3 value (448). A weight shard is quantized on the rank that holds it, so
its scales are sharded with it (a row-parallel shard's scales cover only its columns, and
each rank's partial product is exact to its own scales before the all-reduce).

The reference path (CPU, and GPUs without FP8 matrix products) dequantizes both operands to
float32 and multiplies: it is the test oracle of the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
_MIN_SCALE = 1e-12


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> ``(q [R, C] e4m3, scale [R, 1] float32)`` with ``x ~= q * scale``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 matrix products need compute capability 8.9 or newer (Ada, Hopper)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``y = x W^T + b`` with ``W = wq * w_scale`` (``wq [N, K]`` e4m3, ``w_scale [N, 1]``);
    ``x [..., K]`` is quantized per token on the way in."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_per_row(x2)
    if scaled_mm_supported(x.device):
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.view(1, -1),
                             bias=bias, out_dtype=out_dtype)
    else:
        y = F.linear(dequantize(xq, xs), dequantize(wq, w_scale),
                     None if bias is None else bias.float()).to(out_dtype)
    return y.reshape(*lead, y.shape[-1])

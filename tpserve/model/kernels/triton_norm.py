"""RMSNorm and fused residual-add + RMSNorm as Triton kernels (same semantics as torch_ops).

Layout: ``x`` is ``[..., H]`` and is viewed as ``rows = numel // H`` rows of ``H``; one program
normalises one row held entirely in registers (``BLOCK_H = next_power_of_2(H)``), so each
element is read once and written once. Statistics are float32. As in the reference, the
normalised row is rounded to the input dtype *before* the weight multiply, and the output
dtype is ``promote_types(weight.dtype, x.dtype)``; with ``unit_offset`` (Gemma) the row is
multiplied by ``1 + w`` in float32 and the product rounded to ``x``'s dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.torch_ops import check_sum_out
from tpserve.model.kernels.triton_support import FP_FUSION


@triton.jit
def _normed_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, stride_x, stride_r, stride_s, hidden,
                eps, offs, mask, HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Row ``row``'s ``normed * weight`` (``UNIT_OFFSET``: ``normed * (1 + weight)``, the
    normed row unrounded) in float32, before the output's rounding (the residual sum, when
    given, rounded to its dtype and stored first)."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to its storage dtype: the norm is taken of the stored sum.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return xf * inv_rms * (1.0 + w)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    return normed * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    y = _normed_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, stride_x, stride_r, stride_s, hidden,
                    eps, offs, mask, HAS_RESIDUAL, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


class NormRows(NamedTuple):
    """A norm launch's operands as rows of ``hidden``: ``x`` and ``residual`` (contiguous
    rows), the residual sum's output ``summed`` and its rows ``sum_rows``, and the normed
    output's dtype. Without a residual, ``residual`` and ``sum_rows`` are ``x`` (never
    read: ``HAS_RESIDUAL`` is off) and ``summed`` is None."""

    x: torch.Tensor
    residual: torch.Tensor
    summed: torch.Tensor | None
    sum_rows: torch.Tensor
    out_dtype: torch.dtype


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              sum_out: torch.Tensor | None = None, unit_offset: bool = False) -> NormRows:
    """``NormRows`` of a launch; the residual sum goes to ``sum_out`` (checked as
    ``torch_ops.check_sum_out``; it may be ``residual`` itself: each program reads its row of
    ``x`` and ``residual`` before it stores the sum there), else to a new tensor."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} vs hidden {hidden}"
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = sum_dtype if unit_offset else torch.promote_types(weight.dtype, sum_dtype)
    if residual is None:
        return NormRows(x2, x2, None, x2, out_dtype)
    assert residual.shape == x.shape, f"residual {tuple(residual.shape)} vs {tuple(x.shape)}"
    r2 = residual.reshape(-1, hidden)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    summed = check_sum_out(sum_out, x, residual)
    if summed is None:
        summed = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    return NormRows(x2, r2, summed, summed.view(-1, hidden), out_dtype)


def num_warps_for(block_h: int) -> int:
    return 4 if block_h <= 2048 else (8 if block_h <= 8192 else 16)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            sum_out: torch.Tensor | None = None, unit_offset: bool = False):
    hidden = x.shape[-1]
    r = norm_rows(x, residual, weight, sum_out, unit_offset)
    out = torch.empty(x.shape, dtype=r.out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    x2, r2, summed, s2 = r.x, r.residual, r.summed, r.sum_rows
    rows = x2.shape[0]
    if rows:
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight.contiguous(), out2, s2,
            x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, UNIT_OFFSET=unit_offset,
            enable_fp_fusion=FP_FUSION, num_warps=num_warps_for(block_h),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (see torch_ops.rms_norm)."""
    return _launch(x, None, weight, eps, None, unit_offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    sum_out: torch.Tensor | None = None, unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)`` in one pass over the row (the sum
    in ``sum_out`` when given, see ``norm_rows``)."""
    return _launch(x, residual, weight, eps, sum_out, unit_offset)

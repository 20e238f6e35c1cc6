"""Per-token fp8 quantization fused into the kernels that produce a W8A8 layer's input:
RMSNorm (with the residual add) before qkv and gate/up, the SiLU gate before down.

Each computes exactly what the unfused kernel writes (``triton_norm``, ``triton_activation``:
the same float32 formulas, rounded to the same output dtype), then quantizes those rounded
values per row as ``triton_fp8_quant.quantize_per_token`` does (scale ``max(amax * float32(1/448),
MIN_SCALE)``, ``x / scale`` correctly rounded, clamped to +-448, cast to nearest even). So
the codes and scales equal the unfused pair's bit for bit on the same device, and only the
fp8 codes (half the bytes) are written instead of the 16-bit activations. With
``static_scale`` (an FP8 checkpoint's ``input_scale``, ``[1]`` float32) every row takes that
scale instead, as ``quantize_per_token(..., static_scale=)`` does (values beyond
``448 * scale`` clip), and no amax is taken. With ``group`` (a block-wise checkpoint's
``bk``, a power of two) each row's groups of ``group`` columns take their own amax, as
``quantize_per_group`` does: the scales are ``[rows, groups]``, and the SiLU gate takes one
pass over chunks of whole groups.

- ``rms_norm_fp8`` / ``add_rms_norm_fp8``: one program per row held in registers (as
  ``triton_norm``); the residual sum is still written (it is the next residual).
- ``silu_and_mul_fp8``: one program per row. A row of up to ``ROW_BLOCK_MAX`` columns
  (padded to a power of two) is held in registers: one read of ``[gate | up]``, its amax,
  then the codes. A wider row goes in ``_SILU_BLOCK``-column chunks, two passes: the row's
  amax, then the codes (the gate recomputed, reading ``[gate | up]`` again, mostly from
  L2). Both give the same codes: the per-column values do not depend on the chunking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_activation import _silu_mul_cols, gate_rows
from tpserve.model.kernels.triton_fp8_quant import (
    FP8,
    FP8_MAX,
    INV_FP8_MAX,
    MIN_SCALE,
    _quantize_store,
)
from tpserve.model.kernels.triton_norm import _normed_row, norm_rows, num_warps_for
from tpserve.model.kernels.triton_support import FP_FUSION, tl_dtype

_SILU_BLOCK = 2048
# Llama-3-8B's 14,336 gate columns at tp 1 fit (16,384 lanes, 32 a thread at 16 warps). In
# two passes its 512-row mixed steps took 28.5 us a call on the H200, ~1.3 TB/s
# (results/h200-2026-12-02-r5c-profiled-engine-both.profile.txt).
ROW_BLOCK_MAX = 16384


@triton.jit
def _group_scales(v, s_row, col0, cols, INV_FP8_MAX_C: tl.constexpr,
                  MIN_SCALE_C: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """The scales of ``v``'s (``BLOCK`` float32 columns from ``col0``) groups of ``GROUP``
    columns, each its amax / 448, stored at ``s_row + group`` for the groups that start
    before ``cols``; returns each column's group scale, ``[BLOCK]``."""
    amax = tl.max(tl.reshape(tl.abs(v), (BLOCK // GROUP, GROUP)), 1)
    scales = tl.maximum(amax * INV_FP8_MAX_C, MIN_SCALE_C)
    g = col0 // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_row + g, scales, mask=g * GROUP < cols)
    return tl.reshape(tl.broadcast_to(scales[:, None], (BLOCK // GROUP, GROUP)), (BLOCK,))


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, static_ptr,
    stride_x, stride_r, stride_q, stride_s, stride_sc,
    hidden, eps,
    OUT_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BIT_CAST: tl.constexpr,
    FP8_MAX_C: tl.constexpr, INV_FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    STATIC: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    v = _normed_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, stride_x, stride_r, stride_s, hidden,
                    eps, offs, mask, HAS_RESIDUAL, False)
    v = v.to(OUT_DTYPE).to(tl.float32)  # what the unfused norm stores
    if GROUP > 0:
        scale = _group_scales(v, s_ptr + row * stride_sc, 0, hidden, INV_FP8_MAX_C,
                              MIN_SCALE_C, BLOCK_H, GROUP)
    else:
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(v), 0) * INV_FP8_MAX_C, MIN_SCALE_C)
        tl.store(s_ptr + row * stride_sc, scale)
    _quantize_store(v, q_ptr + row * stride_q, offs, mask, scale, FP8_MAX_C, BIT_CAST)


@triton.jit
def _silu_act(x_row, offs, mask, d):
    """``silu(gate) * up`` of columns ``offs``, rounded as ``triton_activation`` rounds."""
    return _silu_mul_cols(x_row, offs, mask, d).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, stride_sc, d,
    BIT_CAST: tl.constexpr, FP8_MAX_C: tl.constexpr, INV_FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr, STATIC: tl.constexpr, GROUP: tl.constexpr,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    if GROUP > 0:  # chunks of whole groups: one pass, each group its own scale
        for c0 in range(0, d, BLOCK):
            offs = c0 + cols
            v = _silu_act(x_row, offs, offs < d, d)
            scale = _group_scales(v, s_ptr + row * stride_sc, c0, d, INV_FP8_MAX_C,
                                  MIN_SCALE_C, BLOCK, GROUP)
            _quantize_store(v, q_ptr + row * stride_q, offs, offs < d, scale, FP8_MAX_C,
                            BIT_CAST)
    elif ONE_PASS:  # BLOCK >= d: the whole row in registers
        v = _silu_act(x_row, cols, cols < d, d)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(v), 0) * INV_FP8_MAX_C, MIN_SCALE_C)
        tl.store(s_ptr + row, scale)
        _quantize_store(v, q_ptr + row * stride_q, cols, cols < d, scale, FP8_MAX_C, BIT_CAST)
    else:
        if STATIC:  # one pass over the chunks: no amax
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros((BLOCK,), tl.float32)
            for c0 in range(0, d, BLOCK):
                offs = c0 + cols
                amax = tl.maximum(amax, tl.abs(_silu_act(x_row, offs, offs < d, d)))
            scale = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX_C, MIN_SCALE_C)
        tl.store(s_ptr + row, scale)
        for c0 in range(0, d, BLOCK):
            offs = c0 + cols
            v = _silu_act(x_row, offs, offs < d, d)
            _quantize_store(v, q_ptr + row * stride_q, offs, offs < d, scale, FP8_MAX_C,
                            BIT_CAST)


def _consts(device: torch.device, static_scale: torch.Tensor | None, group: int | None,
            block: int) -> dict:
    """The quantization's constexprs; ``GROUP`` 0 unless per group (at most ``block``
    columns: a row shorter than one group is one group)."""
    assert static_scale is None or (static_scale.dtype == torch.float32
                                     and static_scale.numel() == 1)
    assert group is None or (static_scale is None and group & (group - 1) == 0)
    return dict(BIT_CAST=device.type != "cuda", FP8_MAX_C=FP8_MAX, INV_FP8_MAX_C=INV_FP8_MAX,
                MIN_SCALE_C=MIN_SCALE, STATIC=static_scale is not None,
                GROUP=0 if group is None else min(group, block))


def _scales(rows: int, cols: int, group: int | None, device: torch.device) -> torch.Tensor:
    """The scales' buffer: ``[rows, 1]``, or ``[rows, ceil(cols / group)]`` per group."""
    return torch.empty((rows, 1 if group is None else triton.cdiv(cols, group)),
                       dtype=torch.float32, device=device)


def _norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float, sum_out: torch.Tensor | None, static_scale: torch.Tensor | None,
              group: int | None):
    hidden = x.shape[-1]
    r = norm_rows(x, residual, weight, sum_out)
    x2, r2, s2 = r.x, r.residual, r.sum_rows
    rows = x2.shape[0]
    q = torch.empty((rows, hidden), dtype=FP8, device=x.device)
    s = _scales(rows, hidden, group, x.device)
    if rows:
        block_h = triton.next_power_of_2(hidden)
        _rms_norm_fp8_kernel[(rows,)](
            x2, r2, weight.contiguous(), q.view(torch.uint8), s, s2,
            s if static_scale is None else static_scale,
            x2.stride(0), r2.stride(0), q.stride(0), s2.stride(0), s.stride(0), hidden, eps,
            OUT_DTYPE=tl_dtype(r.out_dtype), HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h, enable_fp_fusion=FP_FUSION, num_warps=num_warps_for(block_h),
            **_consts(x.device, static_scale, group, block_h))
    return q, s, r.summed, r.out_dtype


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 static_scale: torch.Tensor | None = None, group: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``quantize_per_token(rms_norm(x, weight, eps), static_scale=)`` (or with ``group``,
    ``quantize_per_group``) in one kernel: ``(q [rows, H] e4m3, scale [rows, 1] (per group:
    [rows, groups]) float32, the dtype rms_norm would return)``."""
    q, s, _, out_dtype = _norm_fp8(x, None, weight, eps, None, static_scale, group)
    return q, s, out_dtype


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, sum_out: torch.Tensor | None = None,
                     static_scale: torch.Tensor | None = None, group: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.Tensor]:
    """``add_rms_norm`` with its normed output quantized (per token, with
    ``static_scale``, or per ``group`` columns): ``(q, scale, dtype, x + residual)`` (the
    sum in ``sum_out`` when given, see ``triton_norm.norm_rows``)."""
    q, s, summed, out_dtype = _norm_fp8(x, residual, weight, eps, sum_out, static_scale,
                                        group)
    return q, s, out_dtype, summed


def silu_and_mul_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                     group: int | None = None, row_block_max: int = ROW_BLOCK_MAX
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``quantize_per_token(silu_and_mul(x), static_scale=)`` (or with ``group``,
    ``quantize_per_group``) in one kernel for ``x = [gate | up]`` ``[rows, 2D]``: ``(q
    [rows, D] e4m3, scale [rows, 1] (per group: [rows, groups]) float32, x.dtype)``. Rows
    whose ``D`` rounds up to at most ``row_block_max`` are read once (the default; a smaller
    value is for tests of the chunked path; per group, chunks hold whole groups and take
    one pass)."""
    x2, d = gate_rows(x)
    rows = x2.shape[0]
    q = torch.empty((rows, d), dtype=FP8, device=x.device)
    s = _scales(rows, d, group, x.device)
    if rows and d:
        full = triton.next_power_of_2(d)
        one_pass = full <= row_block_max
        block = full if one_pass else min(max(_SILU_BLOCK, group or 0), full)
        _silu_and_mul_fp8_kernel[(rows,)](
            x2, q.view(torch.uint8), s, s if static_scale is None else static_scale,
            x2.stride(0), q.stride(0), s.stride(0), d, BLOCK=block, ONE_PASS=one_pass,
            enable_fp_fusion=FP_FUSION,
            num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
            **_consts(x.device, static_scale, group, block))
    return q, s, x.dtype

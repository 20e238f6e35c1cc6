"""The block-scaled fp8 GEMM of block-wise FP8 checkpoints (``model/quant/fp8_block.py`` has
the scheme and the torch references ``reference_block_w8a8`` /
``reference_block_weight_only``).

``block_linear``: weight-only products (decode steps) take the tuned launches of
``triton_fp8.weight_only_linear``, the block scales applied in their K loop, wherever
``block_launch`` fits them to the scales; the rest ``block_gemm``: output tiles
``[BLOCK_M, BLOCK_N]``, the K loop stepping one scale group (``group`` columns, the
checkpoint's ``bk``) at a time. Where the tiles alone would leave SMs idle (decode sizes),
the groups are split over programs (float32 partials, summed in order with the bias added
by ``triton_fp8.reduce_splits``: one kernel). With ``quantize_input`` the activations are
first quantized per token and group (``triton_fp8_quant.quantize_per_group``)
and each step is one ``tl.dot`` of the fp8 tiles (FP8 tensor cores), its float32 sum then
multiplied by the activation rows' group scales and the weight rows' block scales and added
to a float32 accumulator (the per-group promotion vLLM's block kernels do too). Without it
the weight tile is widened to the activations' dtype and multiplied by the unquantized
activations, the block scales applied to each step's sum the same way. Off CUDA (the
interpreter) both operands are widened to float32 (exact products), so the CPU tests run
the same program; a float32 output (float32 models) takes IEEE float32 dots on the GPU as
well.

Launch: the tile shape depends on the static M and N alone, no host synchronisation:
capturable in CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_fp8 import (
    _sm_count,
    block_launch,
    reduce_splits,
    weight_only_blocks,
    weight_only_linear,
)
from tpserve.model.kernels.triton_fp8_quant import FP8, quantize_per_group
from tpserve.model.kernels.triton_support import FP_FUSION


@triton.jit
def _block_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, GROUPS_PER_SPLIT,
                  stride_x, stride_xs, stride_w, stride_ws, stride_y,
                  SCALE_ROWS: tl.constexpr, QUANT_X: tl.constexpr, IEEE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUP: tl.constexpr):
    """Program ``(m, n, s)``: output tile ``m, n`` over groups ``[s * GROUPS_PER_SPLIT,
    (s + 1) * GROUPS_PER_SPLIT)``; with more than one split ``y_ptr`` is the float32
    partials ``[split, M, N]`` (``stride_y`` a row's; no bias)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    ws_rows = ws_ptr + (rn // SCALE_ROWS).to(tl.int64) * stride_ws
    rk = tl.arange(0, GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    g_lo = tl.program_id(2) * GROUPS_PER_SPLIT
    for g in range(g_lo, tl.minimum(g_lo + GROUPS_PER_SPLIT, tl.cdiv(K, GROUP))):
        kk = g * GROUP + rk
        k_ok = kk[None, :] < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        if IEEE:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif QUANT_X:
            part = tl.dot(x, tl.trans(w))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        if QUANT_X:
            part = part * tl.load(xs_ptr + rm.to(tl.int64) * stride_xs + g, mask=m_ok,
                                  other=0.0)[:, None]
        acc += part * tl.load(ws_rows + g, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2).to(tl.int64) * M * stride_y \
        + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class BlockLaunch(NamedTuple):
    """One ``_block_kernel`` launch: output tiles ``block_m`` x ``block_n``, the K groups
    split over ``split`` programs (fewer where the groups run out), and the compiler's
    ``num_warps`` / ``num_stages``."""

    block_m: int
    block_n: int
    split: int
    num_warps: int
    num_stages: int = 3

    @classmethod
    def parse(cls, spec: str) -> BlockLaunch:
        """``"64,64,2,4,3"``: the fields in order (benchmarks' sweeps)."""
        return cls(*(int(v) for v in spec.split(",")))


def tiles(m: int, n: int, groups: int, sms: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, split)`` for a static ``(M, N)`` and ``groups`` K steps: rows in
    tiles of 16 to 128 (the fewest that hold M), columns in 128 unless the grid would then
    have fewer programs than ``sms`` (down to 64). A grid still smaller than ``sms`` splits
    its groups over up to three programs an SM, at least eight groups each (H200, Llama-3-8B
    shapes at 40-64 tokens: qkv and o 4 splits, down 6; ``bench/README.md`` round 20)."""
    bm = min(max(16, triton.next_power_of_2(m)), 128)
    bn = 128
    while bn > 64 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < sms:
        bn //= 2
    n_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if n_tiles >= sms:
        return bm, bn, 1
    return bm, bn, max(1, min(3 * sms // n_tiles, groups // 8))


def block_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, scale_rows: int,
                 group: int, bias: torch.Tensor | None, quantize_input: bool,
                 x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """``x [M, K]`` times ``wq [N, K]`` e4m3 with block scales ``w_scale [N / scale_rows,
    ceil(K / group)]`` float32, plus ``bias [N]``: ``[M, N]`` in ``out_dtype`` (default:
    ``x``'s). With ``quantize_input`` (W8A8) ``x`` is quantized per token and group first,
    unless it already is: e4m3 codes with ``x_scale [M, groups]`` (a producer's).
    Weight-only: ``triton_fp8.weight_only_linear``'s tuned launch where ``block_launch``
    fits it to the scales, else ``block_gemm``."""
    if not quantize_input and (out_dtype or x.dtype) == x.dtype:
        m, k = x.shape
        cfg = block_launch(weight_only_blocks(m, wq.shape[0], k), scale_rows, group)
        if cfg is not None:  # block scales in its K loop
            return weight_only_linear(x.contiguous(), wq, w_scale, bias, cfg,
                                      (scale_rows, group))
    return block_gemm(x, wq, w_scale, scale_rows, group, bias, quantize_input, x_scale,
                      out_dtype)


def block_gemm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, scale_rows: int,
               group: int, bias: torch.Tensor | None, quantize_input: bool,
               x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               launch: BlockLaunch | None = None) -> torch.Tensor:
    """``block_linear`` through ``_block_kernel`` at every M (same arguments); ``launch``
    overrides the one ``tiles`` chooses (benchmarks, tests)."""
    assert wq.dtype == FP8 and x.dim() == 2 and wq.stride(-1) == 1
    assert (x_scale is not None) == (x.dtype == FP8) and (x_scale is None or quantize_input)
    x = x.contiguous()
    m, k = x.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    if x_scale is not None:
        xin, xs = x, x_scale
    elif quantize_input:
        xin, xs = quantize_per_group(x, group)
    else:
        xin, xs = x, w_scale
    groups = triton.cdiv(k, group)
    if launch is None:
        bm, bn, split = tiles(m, n, groups, _sm_count(x.device))
        launch = BlockLaunch(bm, bn, split, 4 if bm * bn <= 64 * 64 else 8)
    bm, bn, split = launch.block_m, launch.block_n, launch.split
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                           device=x.device)
    _block_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        xin, xs, wq, w_scale, bias if bias is not None else w_scale, out, m, n, k, per_split,
        xin.stride(0), xs.stride(0), wq.stride(0), w_scale.stride(0), n,
        SCALE_ROWS=scale_rows, QUANT_X=quantize_input,
        IEEE=x.device.type != "cuda" or y.dtype == torch.float32,
        HAS_BIAS=bias is not None and split == 1, BLOCK_M=bm, BLOCK_N=bn, GROUP=group,
        enable_fp_fusion=FP_FUSION, num_warps=launch.num_warps, num_stages=launch.num_stages)
    reduce_splits(out, None, bias, y, split)
    return y

"""The grouped matrix product of a mixture of experts' layers as a Triton kernel:
``out[rows of group e] = a[rows of group e] @ w[e]^T``, the groups (experts) given by
their row ends on the device (``ends[e]``: group e's rows end there, ascending; the last
end is the rows' count), as ``torch._grouped_mm(a, w.transpose(1, 2), offs=ends)`` computes
it (the torch ops' path and this kernel's test oracle); weight-only fp8 (``--quantization
fp8``): e4m3 codes and a scale per expert and output row.

Each program takes one ``BLOCK_M``-row tile of one group and one ``BLOCK_N`` column tile:
tiles never straddle two groups, so program ``m`` finds its group by counting the tiles
of the groups before it (every program reads the ``E`` ends, a vector of at most
``E_PAD`` entries). The grid is sized for any routing of the step's rows
(``cdiv(rows, BLOCK_M) + E`` row tiles), programs past the step's tiles returning at
once: shapes depend on the step's size only, so it is captured in CUDA graphs. Any
float dtype; float32 products in IEEE float32 (no TF32), every sum in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_support import FP_FUSION, dot_config


@triton.jit
def _grouped_mm_kernel(a_ptr, w_ptr, out_ptr, ends_ptr, scale_ptr, N, K, stride_a, stride_we,
                       stride_wn, stride_o, E: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       SCALED: tl.constexpr):
    tile = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    ends = tl.load(ends_ptr + experts, mask=experts < E, other=0)
    starts = tl.load(ends_ptr + experts - 1, mask=(experts > 0) & (experts < E), other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # one past each group's last tile
    if tile >= tl.sum(tiles, 0):
        return
    e = tl.sum((last <= tile).to(tl.int32), 0)  # the group whose tiles hold this one
    mine = experts == e
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    end = tl.sum(tl.where(mine, ends, 0), 0)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < end, cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    if SCALED:  # fp8 codes: each output column's scale, once on the sum (exact)
        scale = tl.load(scale_ptr + e.to(tl.int64) * N + cols, mask=col_ok, other=0.0)
        acc = acc * scale[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# bf16 experts on CUDA: above this many routed rows per expert (on average) CUTLASS's
# grouped GEMM (``torch._grouped_mm``) is faster than this kernel, below it slower
# (H200, ``bench/time_moe.py``, round 26, whole expert layers: Qwen3-30B-A3B's 128
# experts 1.21-1.49x faster here up to 256 tokens (16 rows each), 1.03x slower at 1,024
# (64 each), 1.35x slower at 8,192 (512); Mixtral's 8 experts 1.14-1.59x faster up to 256
# tokens (64 each), 1.20x slower at 1,024 (256))
CUTLASS_ROWS_PER_EXPERT = 64


def uses_cutlass(rows: int, experts: int, dtype: torch.dtype, device: torch.device,
                 scaled: bool) -> bool:
    """Whether ``grouped_mm`` hands the product to ``torch._grouped_mm``: unscaled bf16 on
    CUDA with more than ``CUTLASS_ROWS_PER_EXPERT`` rows per expert."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and not scaled
            and rows > CUTLASS_ROWS_PER_EXPERT * experts)


def _launch(rows: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) for ``rows`` routed rows of ``n`` columns."""
    if rows <= 256:
        return 16, 64, 128, 4
    return 64, 128, 64, 4


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor,
               scale: torch.Tensor | None = None,
               launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``a`` ``[R, K]`` (rows grouped by expert), ``w`` ``[E, N, K]``, ``ends`` ``[E]``
    int32 -> ``[R, N]`` in ``a``'s dtype. ``w`` may hold e4m3 codes with ``scale``
    ``[E, N]`` float32 (one per output row): each tile widened to the dot dtype in
    registers (exact), the scale applied to the float32 sum. ``launch``: (BLOCK_M, BLOCK_N,
    BLOCK_K, warps) instead of ``_launch``'s (the benchmark's sweep); without it, large
    bf16 steps go to ``torch._grouped_mm`` (``uses_cutlass``)."""
    rows, k = a.shape
    e, n, k_w = w.shape
    if launch is None and uses_cutlass(rows, e, a.dtype, a.device, scale is not None):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    assert k == k_w and a.stride(1) == 1 and w.stride(2) == 1, (a.shape, w.shape)
    assert ends.shape == (e,) and ends.dtype == torch.int32
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0:
        return out
    bm, bn, bk, warps = launch or _launch(rows, n)
    dot_dtype, precision = dot_config(a.dtype, a.device)  # refuses other dtypes
    grid = (triton.cdiv(rows, bm) + e, triton.cdiv(n, bn))
    if scale is not None:
        assert scale.shape == (e, n) and scale.dtype == torch.float32 and scale.is_contiguous()
    _grouped_mm_kernel[grid](a, w, out, ends, scale if scale is not None else ends, n, k,
                             a.stride(0), w.stride(0), w.stride(1), out.stride(0), E=e, E_PAD=triton.next_power_of_2(e),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_DTYPE=dot_dtype,
                             DOT_PRECISION=precision, SCALED=scale is not None,
                             enable_fp_fusion=FP_FUSION, num_warps=warps)
    return out

"""The W8A8 fp8 GEMM as a Triton kernel (``--quantization fp8`` at mid-sized M):
``y = (xq @ wq^T) * x_scale[m] * w_scale[n] (+ b)`` with both operands e4m3.

Why not ``torch._scaled_mm`` everywhere: at decode-batch sizes (M = 33..64) cuBLAS picks
tiles that leave most SMs idle on the Llama-3-8B shapes (the graph-timed sweep of
f8ec81e: ``down`` [4096, 14336] at M = 64 took 43.7 us, 1.3 TB/s of its 58.7 MB, slower
than bf16's 35.7 us; this kernel: 23.3 us). This kernel tiles the output ``[BLOCK_M, BLOCK_N]`` and cuts K into
``split`` contiguous chunks, one program each (float32 partials summed in order by
``triton_fp8.reduce_splits``), so every shape fills the GPU; each step is one
``tl.dot`` of fp8 tiles (FP8 tensor-core products on Hopper and Ada) into a float32
accumulator.

Numerics: the sum of exact e4m3 products, then the activation row's scale (in the
program, so partials are already row-scaled), then the weight channel's scale and the bias
(after the reduction when split). Hopper's fp8 tensor cores keep only about 14 bits of
the running sum (DeepSeek-V3 report, section 3.3.2; Triton's default on sm_90 is to
accumulate a whole K loop that way): each ``BLOCK_K`` step (at most ``PROMOTE_K``
products) is summed in the tensor cores and then added to a float32 accumulator, as
cuBLAS does without fast accumulation. So the result is ``reference_w8a8`` up to float32
summation order, the order of the two scale multiplies and that in-step rounding. Off
CUDA (the interpreter) the fp8 tiles are widened to float32 before the dot (exact), so
the CPU tests run the same program.

Launch: shapes alone choose it (``w8a8_blocks``); the partial buffer is a ``torch.empty``
of a static size; no host synchronisation: capturable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_fp8 import (
    WoConfig,
    _sm_count,
    _tile_rows,
    _wo_epilogue,
    _wo_load,
    reduce_splits,
    split_k,
)
from tpserve.model.kernels.triton_fp8_quant import FP8
from tpserve.model.kernels.triton_support import FP_FUSION

PROMOTE_K = 128  # products summed in the tensor cores before a float32 add (at most)


def one_wave_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """The K split for ``tiles`` output tiles: about one program per SM (the sweep at
    3babef5: two per SM, ``triton_fp8.auto_split``, ran 20-30 % slower), at most one per
    four ``block_k`` steps of K (a static function of the shape and the device)."""
    return max(1, min(sms // tiles, k // (4 * block_k)))


def w8a8_blocks(m: int, n: int, k: int, fast_accum: bool = False) -> WoConfig:
    """The launch (a ``WoConfig`` of kind "w8a8") for a static ``(M, N, K)``, split 0
    (``one_wave_split``). Promoted (``fast_accum`` off): 64 x 128 output tiles, 128-column K
    steps, 4 warps, 4 stages, the sweep's best tile at M = 64 on every llama3-8b shape
    (3babef5; with the float32 promotion at 1ca1fb8 a layer's four GEMMs take 81.8 us
    against cuBLAS's 109.9). 128-row tiles with the promotion hold two 128 x 128 float32
    accumulators per 4 warps and ran slower than cuBLAS at M = 128..512 (1ca1fb8), so larger
    M keep 64-row tiles (the method sends them to cuBLAS:
    ``quant.fp8.W8A8_TRITON_MAX_TOKENS``).

    With fast accumulation no wgmma waits for its float32 add, and 256-column K steps pay:
    the best of two H200 leases' sweeps at M = 64 (``bench/fp8_gemm.py``, results
    ``h200-2026-12-03-r16a``/``-r16b``, us, against the 128 x 128 steps with fast
    accumulation): qkv [6144, 4096] 64 x 64 x 256, 5 stages, 9.45 (12.8); o [4096, 4096]
    64 x 32 x 256, 4 stages, 8.23 (10.25: 128 tiles, no split to reduce); down [4096,
    14336] 64 x 64 x 256, 5 stages, 20.44 (22.53); gate_up [28672, 4096] keeps 64 x 128 x
    128 (33.3, its 224 tiles already more than one wave). The classes below are those
    shapes' (tp shards fall into them by size)."""
    if not fast_accum or n >= 16384:
        return WoConfig("w8a8", 64, 128, 128, 0, 4, 4)
    if n * k <= 4096 * 4096:
        return WoConfig("w8a8", 64, 32, 256, 0, 4, 4)
    return WoConfig("w8a8", 64, 64, 256, 0, 4, 5)


@triton.jit
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, p_ptr, M, N, K, K_CHUNK,
                 stride_x, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                 WIDEN: tl.constexpr, PROMOTE: tl.constexpr, FAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, n, s)``: output tile ``m, n`` over K columns ``s*K_CHUNK ..
    +K_CHUNK`` (a multiple of ``BLOCK_K``). ``WIDEN``: the fp8 tiles go to float32 before
    the dot (the interpreter has no fp8 matmul); else at most ``PROMOTE`` products are
    summed in the tensor cores before each float32 add, or (``FAST``) the whole K chunk's
    sum stays in the tensor cores' own accumulator (Triton's default for fp8 on sm_90)."""
    rm, rn, m_ok, n_ok, x_rows, w_rows = _tile_rows(x_ptr, w_ptr, M, N, stride_x, stride_w,
                                                    BLOCK_M, BLOCK_N)
    pid_k = tl.program_id(2)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = pid_k * K_CHUNK
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        x, w = _wo_load(x_rows, w_rows, k0 + rk, m_ok, n_ok, K, EVEN_K)
        if WIDEN:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
        elif FAST:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
    acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, ws_ptr, b_ptr, y_ptr, p_ptr, stride_y,
                 HAS_BIAS, PARTIAL, True)


def w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                config: WoConfig | str | None = None, fast_accum: bool = False
                ) -> torch.Tensor:
    """``xq [M, K]`` e4m3 with per-row ``x_scale [M, 1]`` float32 (``quantize_per_token``)
    times ``wq [N, K]`` e4m3 with per-channel ``w_scale [N]`` float32, plus ``bias [N]``:
    ``[M, N]`` in ``out_dtype``. ``config`` (a ``WoConfig`` of kind "w8a8" or its string)
    overrides ``w8a8_blocks`` (benchmarks, tests). ``fast_accum`` (``--fp8-fast-accum``, as
    ``_scaled_mm``'s ``use_fast_accum``): each program's K chunk is summed in the fp8 tensor
    cores' own accumulator, never promoted into float32 on the way (off CUDA nothing
    changes: the interpreter's widened dot is exact either way)."""
    assert xq.dtype == FP8 and wq.dtype == FP8, (xq.dtype, wq.dtype)
    assert xq.dim() == 2 and xq.stride(-1) == 1 and wq.stride(-1) == 1
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    cfg = w8a8_blocks(m, n, k, fast_accum) if config is None else config
    if isinstance(cfg, str):
        cfg = WoConfig.parse(cfg)
    if cfg.kind != "w8a8":
        raise ValueError(f"not a w8a8 launch: {cfg}")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = cfg.split or one_wave_split(m_tiles * n_tiles, k, bk, _sm_count(xq.device))
    split, k_chunk, even_k, part = split_k(split, m, n, k, bk, y)
    _w8a8_kernel[(m_tiles, n_tiles, split)](
        xq, x_scale.reshape(-1), wq, w_scale, bias if bias is not None else w_scale, y, part,
        m, n, k, k_chunk, xq.stride(0), wq.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=even_k, PARTIAL=split > 1,
        WIDEN=xq.device.type != "cuda", PROMOTE=min(bk, PROMOTE_K), FAST=fast_accum,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        enable_fp_fusion=FP_FUSION, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_splits(part, w_scale, bias, y, split)
    return y

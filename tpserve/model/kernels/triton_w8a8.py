"""The W8A8 fp8 GEMM as a Triton kernel (``--quantization fp8`` at mid-sized M):
``y = (xq @ wq^T) * x_scale[m] * w_scale[n] (+ b)`` with both operands e4m3.

Why not ``torch._scaled_mm`` everywhere: at decode-batch sizes (M = 33..64) cuBLAS picks
tiles that leave most SMs idle on the Llama-3-8B shapes (the graph-timed sweep of
f8ec81e: ``down`` [4096, 14336] at M = 64 took 43.7 us, 1.3 TB/s of its 58.7 MB, slower
than bf16's 35.7 us; this kernel: 23.3 us). This kernel tiles the output
``[BLOCK_M, BLOCK_N]`` and cuts K into ``split`` contiguous chunks, one program each, so
every shape fills the GPU; each step is one ``tl.dot`` of fp8 tiles (FP8 tensor-core
products on Hopper and Ada) into a float32 accumulator. The float32 partials of a split
launch are summed in order either by a second kernel (``triton_fp8.reduce_splits``) or,
given ``tile_counters``, inside this one: the last of a tile's programs to finish reduces
it (``_last_program_reduces``; one launch fewer per GEMM, ~2 us each on the H200), with
the same float32 operations in the same order, so both paths give the same bits.

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
of a static size, the tile counters a buffer allocated once (``make_tile_counters``) that
every launch leaves at zero; no host synchronisation: capturable in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_fp8 import (
    FP8,
    WoConfig,
    _sm_count,
    _tile_rows,
    _wo_epilogue,
    _wo_load,
    reduce_splits,
    split_k,
)

PROMOTE_K = 128  # products summed in the tensor cores before a float32 add (at most)


def one_wave_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """The K split for ``tiles`` output tiles: about one program per SM (the sweep at
    3babef5: two per SM, ``triton_fp8.auto_split``, ran 20-30 % slower), at most one per
    four ``block_k`` steps of K (a static function of the shape and the device)."""
    return max(1, min(sms // tiles, k // (4 * block_k)))


def w8a8_blocks(m: int, n: int, k: int) -> WoConfig:
    """The launch (a ``WoConfig`` of kind "w8a8") for a static ``(M, N, K)``: 64 x 128
    output tiles, 128-column K steps, 4 warps, 4 stages, split 0 (``one_wave_split``):
    the sweep's best tile at M = 64 on every llama3-8b shape (3babef5; with the float32
    promotion at 1ca1fb8 a layer's four GEMMs take 81.8 us against cuBLAS's 109.9).
    128-row tiles with the promotion hold two 128 x 128 float32 accumulators per 4 warps
    and ran slower than cuBLAS at M = 128..512 (1ca1fb8), so larger M keep 64-row tiles
    (the method sends them to cuBLAS: ``quant.fp8.W8A8_TRITON_MAX_TOKENS``)."""
    return WoConfig("w8a8", 64, 128, 128, 0, 4, 4)


@triton.jit
def _last_program_reduces(rm, rn, m_ok, n_ok, M, N, ws_ptr, b_ptr, y_ptr, p_ptr, c_ptr,
                          stride_y, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Called by every program of a split launch after it stored its partial: it counts
    itself in on its output tile's counter ``c[m * n_tiles + n]``, and the last of the
    tile's ``split`` programs to arrive sums the tile's partials, ``_wo_reduce_kernel``'s
    float32 operations in its order (``0 + p[0] + .. + p[split-1]``, ``* w_scale[n]``,
    ``+ bias[n]``, one cast; with Triton's fp fusion the last two are one FMA in both
    kernels alike), writes y and sets the counter back to zero.

    Ordering (CUTLASS's split-K semaphore; Inductor's grid barrier): a CTA barrier, so
    every thread's partial stores come before the one thread's atomic add, whose release
    (gpu scope) publishes them; its acquire, then a barrier, come before the last
    program's loads of the other programs' partials, which bypass L1 (``.cg``: L1 is not
    coherent between SMs). A program's own partial is read back from memory too: using
    the registers would let the compiler fuse the row-scale multiply into the first add
    (an FMA), a different rounding."""
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    split = tl.num_programs(2)
    tl.debug_barrier()
    arrived = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if arrived == split - 1:
        ok = m_ok[:, None] & n_ok[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for s in range(split):
            p = p_ptr + (s * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            acc += tl.load(p, mask=ok, other=0.0, cache_modifier=".cg")
        acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(c_ptr + tile, 0)


@triton.jit
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, K_CHUNK,
                 stride_x, stride_w, stride_y,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                 FIXUP: tl.constexpr, WIDEN: tl.constexpr, PROMOTE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, n, s)``: output tile ``m, n`` over K columns ``s*K_CHUNK ..
    +K_CHUNK`` (a multiple of ``BLOCK_K``). ``WIDEN``: the fp8 tiles go to float32 before
    the dot (the interpreter has no fp8 matmul); else at most ``PROMOTE`` products are
    summed in the tensor cores before each float32 add. ``PARTIAL``: the row-scaled
    float32 partial goes to ``p[s]``; with ``FIXUP`` the tile's last program then reduces
    the partials into y (``_last_program_reduces``, counters at ``c_ptr``), without it
    ``reduce_splits`` does."""
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
        else:
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE)
    acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, ws_ptr, b_ptr, y_ptr, p_ptr, stride_y,
                 HAS_BIAS, PARTIAL)
    if FIXUP:
        _last_program_reduces(rm, rn, m_ok, n_ok, M, N, ws_ptr, b_ptr, y_ptr, p_ptr, c_ptr,
                              stride_y, HAS_BIAS, BLOCK_M, BLOCK_N)


def _launch_config(m: int, n: int, k: int, config: WoConfig | str | None) -> WoConfig:
    cfg = w8a8_blocks(m, n, k) if config is None else config
    if isinstance(cfg, str):
        cfg = WoConfig.parse(cfg)
    if cfg.kind != "w8a8":
        raise ValueError(f"not a w8a8 launch: {cfg}")
    return cfg


def make_tile_counters(max_m: int, n: int, k: int, device: torch.device,
                  config: WoConfig | str | None = None) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile of the largest grid a ``w8a8_linear`` of
    ``[M <= max_m, K] x [N, K]`` launches (``config`` as there; the table's tiles do not
    depend on M, so that is M = ``max_m``'s grid), for its ``tile_counters``. Allocate
    once and keep: ``w8a8_linear`` leaves them at zero."""
    cfg = _launch_config(max_m, n, k, config)
    tiles = triton.cdiv(max_m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                config: WoConfig | str | None = None,
                tile_counters: torch.Tensor | None = None) -> torch.Tensor:
    """``xq [M, K]`` e4m3 with per-row ``x_scale [M, 1]`` float32 (``quantize_per_token``)
    times ``wq [N, K]`` e4m3 with per-channel ``w_scale [N]`` float32, plus ``bias [N]``:
    ``[M, N]`` in ``out_dtype``. ``config`` (a ``WoConfig`` of kind "w8a8" or its string)
    overrides ``w8a8_blocks`` (benchmarks, tests).

    ``tile_counters`` (int32, at least one per output tile: ``make_tile_counters``): a
    split launch reduces its partials in the GEMM kernel itself (the last program of each
    tile) instead of a second kernel, bit for bit the same result. Invariants: the counters are
    all zero when the call is issued (every call leaves them so, CUDA-graph replays
    included), and no two calls that share them run at the same time (issue them on one
    stream: ``Fp8LinearMethod`` gives every layer its own)."""
    assert xq.dtype == FP8 and wq.dtype == FP8, (xq.dtype, wq.dtype)
    assert xq.dim() == 2 and xq.stride(-1) == 1 and wq.stride(-1) == 1
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    cfg = _launch_config(m, n, k, config)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = cfg.split or one_wave_split(m_tiles * n_tiles, k, bk, _sm_count(xq.device))
    split, k_chunk, even_k, part = split_k(split, m, n, k, bk, y)
    fixup = split > 1 and tile_counters is not None
    if fixup:
        assert (tile_counters.dtype == torch.int32 and tile_counters.device == xq.device
                and tile_counters.numel() >= m_tiles * n_tiles), (
            tile_counters.dtype, tile_counters.device, tile_counters.shape, m_tiles * n_tiles)
    _w8a8_kernel[(m_tiles, n_tiles, split)](
        xq, x_scale.reshape(-1), wq, w_scale, bias if bias is not None else w_scale, y, part,
        tile_counters if fixup else part, m, n, k, k_chunk, xq.stride(0), wq.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN_K=even_k, PARTIAL=split > 1,
        FIXUP=fixup, WIDEN=xq.device.type != "cuda", PROMOTE=min(bk, PROMOTE_K),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fixup:
        reduce_splits(part, w_scale, bias, y, split)
    return y

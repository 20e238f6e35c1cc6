"""The weight-only Triton kernels of ``--quantization fp8`` (see ``model/quant/fp8.py`` for
the scheme and the torch reference ``reference_weight_only``; the per-token quantizer is
``triton_fp8_quant``).

- ``weight_only_linear``: ``y = (x @ widen(q_w)^T) * s_w + b`` for decode-sized M, a
  memory-bound stream of the fp8 weight (half the bytes of bf16): weight tiles
  ``[BLOCK_N, BLOCK_K]`` loaded along K (16-byte loads), widened in registers, float32
  accumulation by CUDA-core FMAs (M <= 2: one activation row per program) or ``tl.dot``
  on bf16 (larger M); K optionally split over programs (float32 partials, a small
  in-order reduce) so the grid fills the SMs; the per-channel scale and bias applied once
  to the K-complete sum. With block scales (block-wise checkpoints, ``block=``) the same
  launches apply them in the K loop (``block_launch`` fits a launch to the scales).
- ``weight_only_silu_mul``: the merged gate/up GEMV at M <= 2 with ``silu(g) * u`` in its
  epilogue (one kernel and no ``[M, 2H]`` intermediate).

All launch with shapes only (no host synchronisation), so they are captured in CUDA
graphs; their block sizes depend on the static M, N, K alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_support import FP_FUSION, dot_config


class WoConfig(NamedTuple):
    """One weight-only launch. ``kind`` "gemv" (+ flags "r", "e"; ``block_m`` 1):
    ``_wo_gemv_kernel``, CUDA-core multiply-adds, one activation row per program (decode:
    M <= 2); "dot": ``tl.dot`` of the activations with the widened weight
    tile (tensor cores, float32 accumulator ``[BLOCK_M, BLOCK_N]``). K is cut into ``split``
    contiguous chunks of whole ``BLOCK_K`` steps, one program each (0: ``auto_split``);
    ``num_warps`` / ``num_stages`` go to the compiler."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int
    num_stages: int = 1

    @classmethod
    def parse(cls, spec: str) -> WoConfig:
        """``"gemvre,1,4,2048,0,4[,stages]"`` (the fields in order)."""
        kind, *nums = spec.split(",")
        return cls(kind, *(int(v) for v in nums))


def auto_split(tiles: int, k: int, block_k: int, sms: int) -> int:
    """The K split for ``tiles`` output tiles: enough programs for two per SM, at most one
    per four ``block_k`` steps of K (a static function of the shape and the device)."""
    return max(1, min(triton.cdiv(2 * sms, tiles), k // (4 * block_k)))


def weight_only_blocks(m: int, n: int, k: int) -> WoConfig:
    """The launch for a static ``(M, N, K)``, from the CUDA-graph-timed sweeps of
    ``bench/fp8_gemm.py --sweep`` on an H200 (llama3-8b shapes): at M = 1 the one-row GEMV
    over 4 x 2048-byte weight tiles, evict-first, summed each step (94e9eb8: 62.1 us for a
    layer's four GEMMs against 89.2 us for the earlier fma/dot launches and 116.0 us in bf16;
    3.5-4.0 TB/s on gate_up and down); M = 2 the same GEMV over 32 x 512 tiles, 8 warps
    (89.3 against 96.9 us); M = 3..16 a 16-row dot over 32 x 256 tiles, three stages of
    cp.async pipelining, K split to two programs per SM (90fc4f7: the single best launch at
    every shape there; the GEMV rereads the weight per row and loses from M = 4);
    M = 17..32 a 32 x 64 x 128 dot. Larger M a 64 x 64 x 128 dot. Above M = 1 these run
    only with a raised ``--fp8-weight-only-max-tokens`` (per-channel W8A8 is faster there,
    ``quant.fp8.DEFAULT_WEIGHT_ONLY_MAX_TOKENS``)."""
    if m == 1:
        return WoConfig("gemvre", 1, 4, 2048, 0, 4)
    if m == 2:
        return WoConfig("gemvre", 1, 32, 512, 0, 8)
    if m <= 16:
        return WoConfig("dot", 16, 32, 256, 0, 4, 3)
    if m <= 32:
        return WoConfig("dot", 32, 64, 128, 0, 4, 3)
    return WoConfig("dot", 64, 64, 128, 0, 4, 3)


@triton.jit
def _tile_rows(x_ptr, w_ptr, M, N, stride_x, stride_w, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Program ``(m, n, .)``'s output rows ``rm`` and columns ``rn``, their masks, and the
    row pointers of its activations ``[BLOCK_M, 1]`` and weight rows ``[BLOCK_N, 1]``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (rm, rn, rm < M, rn < N, x_ptr + rm.to(tl.int64)[:, None] * stride_x,
            w_ptr + rn.to(tl.int64)[:, None] * stride_w)


@triton.jit
def _wo_load(x_rows, w_rows, kk, m_ok, n_ok, K, EVEN_K: tl.constexpr):
    """The ``[BLOCK_M, BLOCK_K]`` activations and ``[BLOCK_N, BLOCK_K]`` fp8 weights at
    columns ``kk`` (zero outside M, N and K)."""
    if EVEN_K:
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k_ok = kk[None, :] < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    return x, w


@triton.jit
def _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, s_ptr, b_ptr, y_ptr, p_ptr,
                 stride_y, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                 HAS_SCALE: tl.constexpr):
    """Unsplit: ``y = acc * s_w[n] (+ b[n])`` cast to y's dtype (without ``HAS_SCALE``, block
    scales: ``acc`` is already scaled). Split (``PARTIAL``): the float32 partial sum goes to
    ``p[pid_k, m, n]`` (contiguous ``[split, M, N]``) for ``_wo_reduce_kernel``."""
    ok = m_ok[:, None] & n_ok[None, :]
    if not PARTIAL:
        if HAS_SCALE:
            acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        p = p_ptr + (pid_k * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(p, acc, mask=ok)


@triton.jit
def _gemv_rows(x_row, w_ptr, rn, n_ok, k_lo, K, K_CHUNK, stride_w, ws_row,
               EVEN_K: tl.constexpr, REDUCE_EACH: tl.constexpr, EVICT: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """``sum_k x[k] * widen(w[n, k])`` over ``k_lo .. k_lo + K_CHUNK`` for the weight rows
    ``rn``: float32 ``[BLOCK_N]``. Each step loads a ``[BLOCK_N, BLOCK_K]`` fp8 tile
    (contiguous along K: 16-byte loads), widens it to float32 and multiplies it by the
    row's ``[BLOCK_K]`` slice broadcast over N (a 2-D layout: the earlier 3-D ``[1, N, K]``
    one ran at 50-60 % of HBM). ``REDUCE_EACH`` sums each step's products over K at once
    (a ``[BLOCK_N]`` accumulator) instead of keeping a ``[BLOCK_N, BLOCK_K]`` one;
    ``EVICT`` marks the weight stream evict-first in L2 (it is read once a step) so the
    activations stay cached. ``GROUP`` (block scales, else 0): the weight rows ``rn`` share
    one row of block scales ``ws_row`` (one per ``GROUP`` columns; ``GROUP`` and
    ``BLOCK_K`` divide one another, every ``k0`` a multiple of the smaller), and the
    activations are multiplied by their columns' scales in float32 before the products."""
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_w
    if REDUCE_EACH:
        acc = tl.zeros((BLOCK_N,), tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w_ok = n_ok[:, None]
            x = tl.load(x_row + kk)
        else:
            w_ok = n_ok[:, None] & (kk[None, :] < K)
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
        # the weight load is issued before anything waits on x (converting x first made
        # the per-channel GEMV 19 % slower at M = 1 on the H200: round 19)
        if EVICT:
            w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)
        x = x.to(tl.float32)
        if GROUP > 0:
            g = k0 // GROUP + rk // GROUP  # constant over runs of GROUP columns
            if EVEN_K:
                x = x * tl.load(ws_row + g)
            else:
                x = x * tl.load(ws_row + g, mask=kk < K, other=0.0)
        prod = w.to(tl.float32) * x[None, :]
        if REDUCE_EACH:
            acc += tl.sum(prod, axis=1)
        else:
            acc += prod
    if not REDUCE_EACH:
        acc = tl.sum(acc, axis=1)
    return acc


@triton.jit
def _wo_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, M, N, K, K_CHUNK,
                    stride_x, stride_w, stride_y, stride_s,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                    REDUCE_EACH: tl.constexpr, EVICT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    SCALE_ROWS: tl.constexpr):
    """Program ``(m, n, s)``: activation row ``m`` (``BLOCK_M`` is 1), weight rows
    ``n*BLOCK_N..``, K columns ``s*K_CHUNK .. +K_CHUNK`` (``K_CHUNK`` a multiple of
    ``BLOCK_K``), by ``_gemv_rows``. Block scales (``GROUP``): ``s_ptr`` is ``[N /
    SCALE_ROWS, groups]`` (row stride ``stride_s``), ``BLOCK_N`` divides ``SCALE_ROWS``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m + tl.arange(0, 1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    ws_row = s_ptr + (pid_n * BLOCK_N // SCALE_ROWS).to(tl.int64) * stride_s
    acc = _gemv_rows(x_ptr + pid_m.to(tl.int64) * stride_x, w_ptr, rn, n_ok, pid_k * K_CHUNK,
                     K, K_CHUNK, stride_w, ws_row, EVEN_K, REDUCE_EACH, EVICT, BLOCK_N,
                     BLOCK_K, GROUP)
    _wo_epilogue(acc[None, :], rm, rn, pid_k, rm < M, n_ok, M, N, s_ptr, b_ptr, y_ptr, p_ptr,
                 stride_y, HAS_BIAS, PARTIAL, GROUP == 0)


@triton.jit
def _wo_gemv_silu_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, HALF, K,
                         stride_x, stride_w, stride_y, stride_s,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                         REDUCE_EACH: tl.constexpr, EVICT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                         SCALE_ROWS: tl.constexpr):
    """A merged gate/up weight ``[2 * HALF, K]`` (gate rows, then up rows) and its SiLU
    gate in one pass: program ``(m, n)`` computes ``g`` over gate rows ``n*BLOCK_N..`` and
    ``u`` over the same rows of the up half (whole K, no split), both scaled per channel
    (plus bias), and writes ``y[m, n] = silu(g) * u`` from float32. Block scales
    (``GROUP``, as ``_wo_gemv_kernel``; ``SCALE_ROWS`` also divides ``HALF``) take the
    place of the per-channel ones."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < HALF
    x_row = x_ptr + pid_m.to(tl.int64) * stride_x
    g_row = pid_n * BLOCK_N // SCALE_ROWS
    g = _gemv_rows(x_row, w_ptr, rn, n_ok, 0, K, K, stride_w,
                   s_ptr + g_row.to(tl.int64) * stride_s, EVEN_K, REDUCE_EACH, EVICT,
                   BLOCK_N, BLOCK_K, GROUP)
    u = _gemv_rows(x_row, w_ptr, rn + HALF, n_ok, 0, K, K, stride_w,
                   s_ptr + (g_row + HALF // SCALE_ROWS).to(tl.int64) * stride_s, EVEN_K,
                   REDUCE_EACH, EVICT, BLOCK_N, BLOCK_K, GROUP)
    if GROUP == 0:
        g = g * tl.load(s_ptr + rn, mask=n_ok, other=0.0)
        u = u * tl.load(s_ptr + HALF + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        g += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + HALF + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + pid_m.to(tl.int64) * stride_y + rn, y.to(y_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def _wo_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, p_ptr, M, N, K, K_CHUNK,
                   stride_x, stride_w, stride_y, stride_s,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr):
    """As ``_wo_gemv_kernel`` (same grid and chunks, ``BLOCK_M`` rows), but each step is
    ``tl.dot`` of the ``[BLOCK_M, BLOCK_K]`` activations and the transposed
    ``[BLOCK_N, BLOCK_K]`` weight tile, both in ``DOT_DTYPE`` (e4m3 is exact in bf16, fp16
    and fp32). Block scales (``GROUP``, a multiple of ``BLOCK_K``): each step's float32 sum
    is multiplied by its weight rows' scales of the step's group, then accumulated."""
    rm, rn, m_ok, n_ok, x_rows, w_rows = _tile_rows(x_ptr, w_ptr, M, N, stride_x, stride_w,
                                                    BLOCK_M, BLOCK_N)
    pid_k = tl.program_id(2)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = pid_k * K_CHUNK
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        x, w = _wo_load(x_rows, w_rows, k0 + rk, m_ok, n_ok, K, EVEN_K)
        if GROUP > 0:
            part = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)),
                          input_precision=DOT_PRECISION)
            # a chunk may run past K (split_k): its products are zero there, times the last
            # group's (finite) scale, never one beyond the weight's groups
            g = tl.minimum(k0, K - 1) // GROUP
            ws = tl.load(s_ptr + (rn // SCALE_ROWS).to(tl.int64) * stride_s + g, mask=n_ok,
                         other=0.0)
            acc += part * ws[None, :]
        else:
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), acc,
                         input_precision=DOT_PRECISION)
    _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, s_ptr, b_ptr, y_ptr, p_ptr, stride_y,
                 HAS_BIAS, PARTIAL, GROUP == 0)


@triton.jit
def _wo_reduce_kernel(p_ptr, s_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_y,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``y[m, n] = (sum_s p[s, m, n]) * s_w[n] (+ b[n])`` (without ``HAS_SCALE``: no
    ``s_w``) over ``BLOCK`` flat outputs per program, the splits summed in order
    (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N).to(tl.int64) * stride_y + n, acc.to(y_ptr.dtype.element_ty),
             mask=ok)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: an H100/H200's count, so CPU tests take the same splits


def block_launch(cfg: WoConfig, scale_rows: int, group: int) -> WoConfig | None:
    """``cfg`` for block scales (one per ``scale_rows`` weight rows and ``group`` columns),
    or None where that launch cannot apply them: a GEMV tile's rows must share one row of
    scales (``block_n`` divides ``scale_rows``) and its steps span whole groups or lie in
    one; a dot's steps are cut to the largest power of two that divides the group."""
    if cfg.kind.startswith("gemv"):
        ok = scale_rows % cfg.block_n == 0 and (cfg.block_k % group == 0
                                                or group % cfg.block_k == 0)
        return cfg if ok else None
    return cfg._replace(block_k=min(cfg.block_k, group & -group))


def weight_only_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None, config: WoConfig | str | None = None,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype, contiguous rows) times ``wq [N, K]`` e4m3 (contiguous
    rows) scaled by ``w_scale [N]`` float32, plus ``bias [N]``: ``[M, N]`` in x's dtype.

    ``y = (x @ widen(wq)^T) * w_scale + bias``: the fp8 weight is read once per M tile,
    widened in registers, products summed in float32; the per-channel scale (and the bias)
    applied once to the K-complete float32 sum (after the split reduction when split).
    ``config`` (a ``WoConfig`` or its string) overrides ``weight_only_blocks``
    (benchmarks, tests). ``block`` ``(scale_rows, group)``: ``w_scale`` is block scales
    ``[N / scale_rows, ceil(K / group)]`` (a block-wise checkpoint's), applied in the K loop
    (``block_launch`` adapts the launch; ValueError where it cannot). Shapes alone choose
    the launch and the partial buffer is a ``torch.empty`` of a static size: capturable in
    CUDA graphs."""
    assert x.dim() == 2 and x.stride(-1) == 1 and wq.stride(-1) == 1
    m, k = x.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = weight_only_blocks(m, n, k) if config is None else config
    if isinstance(cfg, str):
        cfg = WoConfig.parse(cfg)
    scale_rows, group = block or (1, 0)
    if block is not None:
        fitted = block_launch(cfg, scale_rows, group)
        if fitted is None:
            raise ValueError(f"launch {cfg} cannot apply block scales {block}")
        cfg = fitted
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = cfg.split or auto_split(m_tiles * n_tiles, k, bk, _sm_count(x.device))
    split, k_chunk, even_k, part = split_k(split, m, n, k, bk, y)
    b = bias if bias is not None else w_scale
    args = (x, wq, w_scale, b, y, part, m, n, k, k_chunk, x.stride(0), wq.stride(0),
            y.stride(0), w_scale.stride(0))
    grid = (m_tiles, n_tiles, split)
    common = dict(HAS_BIAS=bias is not None, EVEN_K=even_k, PARTIAL=split > 1, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, GROUP=group, SCALE_ROWS=scale_rows,
                  enable_fp_fusion=FP_FUSION, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.kind.startswith("gemv"):  # "gemv" + flags: r REDUCE_EACH, e EVICT
        assert bm == 1, "a gemv launch has one activation row per program"
        flags = cfg.kind[4:]
        del common["BLOCK_M"]
        _wo_gemv_kernel[grid](*args, REDUCE_EACH="r" in flags, EVICT="e" in flags, **common)
    elif cfg.kind == "dot":
        dot_dtype, precision = dot_config(x.dtype, x.device)
        _wo_dot_kernel[grid](*args, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, **common)
    else:
        raise ValueError(f"unknown weight-only kind {cfg.kind!r}")
    reduce_splits(part, None if block else w_scale, bias, y, split)
    return y


def split_k(split: int, m: int, n: int, k: int, block_k: int, y: torch.Tensor
            ) -> tuple[int, int, bool, torch.Tensor]:
    """The K chunks of a split-K launch asked for ``split`` programs along K: ``(split,
    chunk, even, partials)`` with every chunk whole ``block_k`` steps and none empty,
    ``even`` when the chunks cover K exactly (no K masks), and the float32 ``[split, M, N]``
    partials (``y`` itself when unsplit): a static function of the shapes."""
    steps = triton.cdiv(k, block_k)
    split = max(1, min(split, steps))
    chunk = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(k, chunk)  # no empty chunk
    part = (torch.empty((split, m, n), dtype=torch.float32, device=y.device)
            if split > 1 else y)
    return split, chunk, chunk * split == k, part


def reduce_splits(part: torch.Tensor, w_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, y: torch.Tensor, split: int) -> None:
    """``y = (sum of the split partials) * w_scale (+ bias)`` (``_wo_reduce_kernel``;
    ``w_scale`` None: the partials are already scaled); a no-op when unsplit (the GEMM
    wrote ``y`` itself)."""
    if split == 1:
        return
    m, n = y.shape
    block = 1024
    _wo_reduce_kernel[(triton.cdiv(m * n, block),)](
        part, part if w_scale is None else w_scale, part if bias is None else bias, y, m, n,
        split, y.stride(0), HAS_SCALE=w_scale is not None, HAS_BIAS=bias is not None,
        BLOCK=block, enable_fp_fusion=FP_FUSION, num_warps=4)


def weight_only_silu_mul(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None, block: tuple[int, int] | None = None
                         ) -> torch.Tensor | None:
    """``silu(g) * u`` where ``[g | u] = weight_only_linear(x, wq, w_scale, bias)`` (the
    merged gate/up layer: ``wq [2H, K]``, gate rows first), in one kernel for the M whose
    launch is a GEMV (``weight_only_blocks``: M <= 2) and whose grid needs no K split;
    ``None`` for any other shape (the caller multiplies and gates separately). The gate
    is taken from the float32 sums, so the result is the unfused one without the rounding
    of ``g`` and ``u`` to x's dtype. ``block`` as ``weight_only_linear`` (``None`` also
    where the launch cannot apply the block scales or a scale block spans both halves)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and wq.stride(-1) == 1
    m, k = x.shape
    n = wq.shape[0]
    cfg = weight_only_blocks(m, n, k)
    if m == 0 or n % 2 or not cfg.kind.startswith("gemv"):
        return None
    half = n // 2
    scale_rows, group = block or (1, 0)
    if block is not None and (block_launch(cfg, scale_rows, group) is None
                              or half % scale_rows):
        return None
    tiles = m * triton.cdiv(half, cfg.block_n)
    if auto_split(tiles, k, cfg.block_k, _sm_count(x.device)) > 1:
        return None
    y = torch.empty((m, half), dtype=x.dtype, device=x.device)
    flags = cfg.kind[4:]
    _wo_gemv_silu_kernel[(m, triton.cdiv(half, cfg.block_n))](
        x, wq, w_scale, bias if bias is not None else w_scale, y, half, k,
        x.stride(0), wq.stride(0), y.stride(0), w_scale.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, REDUCE_EACH="r" in flags, EVICT="e" in flags,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP=group, SCALE_ROWS=scale_rows,
        enable_fp_fusion=FP_FUSION, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y

"""The WNA16 GEMM as Triton kernels (``--quantization gptq`` / ``awq`` /
``compressed-tensors``): integer weights (4 or 8 bits, packed along K) with float group
scales and zero points, activations in fp16 / bf16 / fp32. See ``model/quant/wna16.py`` for
the served layout (``perm``, ``runs``) and the torch reference ``linear``.

Numerics: every weight is the reference's, dequantized as ``triton_wna16_codes`` states;
products go through ``tl.dot`` into float32; the bias is added to the K-complete float32
sum; the output rounded once. So each product is the reference's up to float32 summation
order and the output's rounding.

Two paths, chosen by M and the dtype (``wna16_blocks``, static: CUDA graphs capture either):
- the fused GEMM (``_wna16_kernel``, M up to ``DEQUANT_MIN_M - 1``): each program
  dequantizes its weight tile in registers. A K step loads ``BLOCK_K / pack`` packed rows
  once, shifts every word by each code's offset into ``[BLOCK_K / pack, PACK, BLOCK_N]``
  (column ``pack * r + j`` at ``(r, j)``) and multiplies the contiguous activation columns
  ``k0 .. k0 + BLOCK_K`` (through ``perm`` when the served columns are sorted): one
  ``tl.dot`` of ``BLOCK_K`` columns a step, or at one activation row (``BLOCK_M`` 1) a GEMV
  on the CUDA cores (in fp16 on CUDA with integer zero points, launch kind "wna16p": two
  codes become an fp16 pair per 32-bit operation, by PTX; the default since round 33).
  Scales and zero points:
  ``SCALES`` 0: one row a K step (groups in column order, ``BLOCK_K`` dividing the group:
  ``runs``), 1: one row a packed row (smaller groups in order), 2: one per column through
  ``g_idx`` (groups in any order: act-order columns that could not be sorted into even
  runs). Decode splits K over programs (``fill_split``) so a few output tiles still fill
  the GPU; float32 partials in a ``torch.empty`` of a static size, summed in order by
  ``triton_fp8.reduce_splits``.
- larger M: the weight dequantized into a ``[K, N]`` scratch in the activation dtype
  (``wna16_dequantize``: rows written back in the checkpoint's column order through
  ``perm``) and multiplied by cuBLAS (``torch.addmm`` / ``matmul``): the dequantization
  (one read of the codes, one write) is paid once for all M rows, and the product runs at
  the dense rate. The scratch is a transient of the step: the start-up profile counts it,
  and the graphs' reserve adds the largest (``wna16_method.graph_scratch_bytes``).
No host synchronisation on either path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_fp8 import (
    WoConfig,
    _sm_count,
    _wo_epilogue,
    reduce_splits,
    split_k,
)
from tpserve.model.kernels.triton_support import FP_FUSION, dot_config
from tpserve.model.kernels.triton_wna16_codes import (
    _code,
    _gemv_pairs_step,
    _group_rows,
    _step_weights,
)
from tpserve.model.quant.wna16 import DEQUANT_MIN_M, pack_factor

DEQUANT = WoConfig("dequant", 0, 0, 0, 1, 0)
# the one-row launches (split 0: ``fill_split``): the plain GEMV, and the GEMV with code
# pairs where they apply (``_code_pairs``)
GEMV = WoConfig("wna16", 1, 128, 128, 0, 4, 3)
PAIRS_GEMV = WoConfig("wna16p", 1, 64, 128, 0, 4, 3)


def fill_split(tiles: int, k: int, block_k: int, sms: int, block_m: int = 16) -> int:
    """The K split for ``tiles`` output tiles of ``block_m`` rows: enough programs for four
    per SM (the H100 sweeps of round 31: 5-20 % faster than two), at most one per two
    ``block_k`` steps of K (``triton_fp8.auto_split`` allows one per four, which leaves a
    tp-8 shard at decode, 8 tiles of 512 x 4096, on 64 of 132 SMs; here 128); the one-row
    GEMV at most one per step (its 128-column tiles leave a tp-8 shard of 768 x 4096 six)."""
    steps = k // block_k if block_m == 1 else k // (2 * block_k)
    return max(1, min(triton.cdiv(4 * sms, tiles), steps))


def wna16_blocks(m: int, n: int, k: int, sms: int, dtype: torch.dtype,
                 pairs: bool = False) -> WoConfig:
    """The launch (a ``WoConfig``: kind "wna16", "wna16p" or "wna16t", its ``split`` by
    ``fill_split``; or ``DEQUANT``) for a static ``(M, N, K)`` on ``sms`` SMs, from the
    CUDA-graph-timed sweeps of ``bench/time_wna16.py`` on an H100 (llama3-8b shapes): one
    row, where the code pairs apply (``pairs``: ``_code_pairs``, the fp16 GEMV on CUDA with
    integer zero points and scales per step or packed row), the pairs GEMV over 64-column
    tiles (round 33, a layer's four products: 4-bit 86.6 us against 110.7 in groups of 128
    and 83.2 against 141.4 in groups of 32, 8-bit 117.3 against 131.1 and 107.9 against
    176.4; cuBLAS fp16 157), else the GEMV over 128-column tiles (round 31: 4.5-6x faster
    than over 64 columns, 1.3x the 16-row dot). fp16 / bf16: up to 16 rows the transposed
    product over 16 x 128 tiles, up to 32 rows over 32 x 128 (``W x^T``, the dequantized
    tile as wgmma's register operand; rounds 33 and 35, 1.05-1.20x the 16 x 64 tile at
    2-16 rows and 1.01-1.25x the 64 x 128 one at 32 for 4 and 8 bits, groups of 128 and 32,
    act-order, float offsets and bf16, but 0.99x for 8-bit bf16 at 32; where they fill the
    SMs, else 16 x 64 and 64 x 128 tiles), then up to
    ``DEQUANT_MIN_M - 1`` rows 64 x 128 tiles (4 warps: 8 were 5-10 % slower, 128-row
    tiles 15-60 %; the transposed ones lost from 64 rows); all over 128-column K steps, K
    split to fill the SMs. float32 activations keep 16 x 64 tiles above one row: their
    products run on the CUDA cores (``ieee``), so larger tiles gain nothing, and a 64 x 128
    tile with per-column groups needs 238,080 bytes of shared memory, over an H100's
    232,448 (round 31: the launch was refused). From ``DEQUANT_MIN_M`` the dequantized
    weight times cuBLAS."""
    if m >= DEQUANT_MIN_M:
        return DEQUANT
    if m == 1:
        return _split(PAIRS_GEMV if pairs else GEMV, m, n, k, sms)[0]
    if m <= 16 or dtype == torch.float32:
        plain = WoConfig("wna16", 16, 64, 128, 0, 4, 3)
    else:
        plain = WoConfig("wna16", 64, 128, 128, 0, 4, 3)
    if dtype != torch.float32 and m <= 32:
        swapped, programs = _split(WoConfig("wna16t", 16 if m <= 16 else 32, 128, 128, 0,
                                            4, 3), m, n, k, sms)
        # the 128-column tiles leave a tp-8 shard of 512 x 4096 at 64 programs, where the
        # 16 x 64 tile gives 128: the narrower tile there
        if programs >= 0.9 * sms:
            return swapped
    return _split(plain, m, n, k, sms)[0]


def _split(cfg: WoConfig, m: int, n: int, k: int, sms: int) -> tuple[WoConfig, int]:
    """``cfg`` with its K split (``fill_split``) and the programs it launches."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = fill_split(tiles, k, cfg.block_k, sms, cfg.block_m)
    return cfg._replace(split=split), tiles * split


def default_launch(m: int, n: int, k: int, sms: int, dtype: torch.dtype, device: torch.device,
                   offset: bool, runs: tuple[int, int] | None, pack: int) -> WoConfig:
    """``wna16_blocks`` for one call's operands: the one-row launch takes the code pairs
    where ``_code_pairs`` says they apply (its scales read under the GEMV's K steps)."""
    pairs = _code_pairs(PAIRS_GEMV.kind, 1, dtype, device, offset,
                        scale_mode(runs, PAIRS_GEMV.block_k, pack))
    return wna16_blocks(m, n, k, sms, dtype, pairs)


def scale_mode(runs: tuple[int, int] | None, block_k: int, pack: int) -> int:
    """``SCALES`` for groups ``runs`` (``(first, size)``: ``g_idx == first + k // size``;
    None: any order) under K steps of ``block_k`` columns."""
    if runs is None:
        return 2
    return 0 if runs[1] % block_k == 0 else 1 if runs[1] % pack == 0 else 2


@triton.jit
def _wna16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, perm_ptr, b_ptr, y_ptr, p_ptr,
                  M, N, K, K_CHUNK, FIRST, GROUP_SIZE, stride_x, stride_q, stride_s, stride_y,
                  BITS: tl.constexpr, SCALES: tl.constexpr, HAS_PERM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                  MAGIC: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  ROUND_BF16: tl.constexpr, OFFSET: tl.constexpr, SWAP: tl.constexpr,
                  PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Program ``(m, n, s)``: output tile ``m, n`` over K columns ``s*K_CHUNK ..
    +K_CHUNK`` (whole ``BLOCK_K`` steps; K itself a multiple of ``PACK``). A step
    dequantizes its ``[BLOCK_K, BLOCK_N]`` weight tile (``_step_weights``) and loads the
    activations of the same ``BLOCK_K`` columns (through ``perm`` with ``HAS_PERM``).
    ``BLOCK_M`` 1 (one activation row, decode) is a GEMV: float32 multiply-adds on the CUDA
    cores into a ``[ROWS, BLOCK_N]`` accumulator (the pack axis summed each step, the rows
    at the end); otherwise one ``tl.dot`` of ``BLOCK_K`` columns a step (``SWAP``, launch
    kind "wna16t": as ``W x^T``, the dequantized tile the product's first operand, which
    sm_90's wgmma takes from registers; the 16-row tile otherwise runs ``mma`` v2, both
    operands through shared memory). Columns past K
    load weight 0 and activation 0: they add nothing. Offsets inside ``qweight``,
    ``scales`` and ``zeros`` are int32 (the wrapper checks their sizes)."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    act_dtype = x_ptr.dtype.element_ty
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    if BLOCK_M == 1:
        acc_rows = tl.zeros((ROWS, BLOCK_N), tl.float32)
        # the step's columns as [ROWS, PACK], the weight tile's first two axes
        kk2 = tl.arange(0, ROWS)[:, None] * PACK + tl.arange(0, PACK)[None, :]
    elif SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_lo = pid_k * K_CHUNK
    for k0 in range(k_lo, k_lo + K_CHUNK, BLOCK_K):
        if PAIRS:
            acc_rows = _gemv_pairs_step(
                acc_rows, x_ptr + tl.program_id(0).to(tl.int64) * stride_x, q_ptr, s_ptr,
                z_ptr, perm_ptr, k0, rn, n_ok, K, FIRST, GROUP_SIZE, stride_q, stride_s, BITS,
                SCALES, EVEN_K, HAS_PERM, BLOCK_K, BLOCK_N)
        else:
            w = _step_weights(q_ptr, s_ptr, z_ptr, g_ptr, k0, rn, n_ok, K, FIRST, GROUP_SIZE,
                              stride_q, stride_s, BITS, SCALES, EVEN_K, MAGIC, ROUND_BF16,
                              OFFSET, act_dtype, BLOCK_K)
            if BLOCK_M == 1:
                kk = k0 + kk2
                x_ok = kk < K
                if HAS_PERM:
                    kk = tl.load(perm_ptr + kk, mask=x_ok, other=0)
                x = tl.load(x_ptr + tl.program_id(0).to(tl.int64) * stride_x + kk, mask=x_ok,
                            other=0.0)
                acc_rows += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32), axis=1)
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < K
                if HAS_PERM:
                    kk = tl.load(perm_ptr + kk, mask=k_ok, other=0)
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.reshape(w, (BLOCK_K, BLOCK_N))
                if SWAP:
                    acc_t = tl.dot(tl.trans(w).to(DOT_DTYPE), tl.trans(x).to(DOT_DTYPE), acc_t,
                                   input_precision=DOT_PRECISION)
                else:
                    acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc,
                                 input_precision=DOT_PRECISION)
    if BLOCK_M == 1:
        acc = tl.sum(acc_rows, axis=0)[None, :]
    elif SWAP:
        acc = tl.trans(acc_t)
    _wo_epilogue(acc, rm, rn, pid_k, m_ok, n_ok, M, N, s_ptr, b_ptr, y_ptr, p_ptr, stride_y,
                 HAS_BIAS, PARTIAL, False)


@triton.jit
def _wna16_dequant_kernel(q_ptr, s_ptr, z_ptr, g_ptr, perm_ptr, w_ptr, N, K, FIRST,
                          GROUP_SIZE, stride_q, stride_s, stride_w, BITS: tl.constexpr,
                          SCALES: tl.constexpr, HAS_PERM: tl.constexpr, MAGIC: tl.constexpr,
                          ROUND_BF16: tl.constexpr, OFFSET: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(r, n)``: packed rows ``r*ROWS ..`` of columns ``n*BLOCK_N ..`` written
    as ``W[k, n]`` (``k = perm[c]`` for served column ``c`` with ``HAS_PERM``) in w's dtype.
    ``SCALES`` 0 needs ``ROWS * PACK`` to divide the group size (a launch of whole groups)."""
    PACK: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, n_ok = rows < K // PACK, rn < N
    ok = row_ok[:, None] & n_ok[None, :]
    packed = tl.load(q_ptr + rows[:, None] * stride_q + rn[None, :], mask=ok, other=0)
    k0 = tl.program_id(0) * ROWS * PACK
    s, z = _group_rows(s_ptr, z_ptr, rows, k0, rn, row_ok, n_ok, K, FIRST, GROUP_SIZE,
                       stride_s, PACK, SCALES, MAGIC)
    for j in tl.static_range(PACK):
        w, kk = _code(packed, j, s, z, rows, rn, row_ok, n_ok, s_ptr, z_ptr, g_ptr, perm_ptr,
                      stride_s, BITS, SCALES, HAS_PERM, MAGIC, ROUND_BF16, OFFSET,
                      w_ptr.dtype.element_ty)
        tl.store(w_ptr + kk.to(tl.int64)[:, None] * stride_w + rn[None, :], w, mask=ok)


def _check_operands(qweight, scales, zeros, g_idx, bits, dtype, perm):
    pack = pack_factor(bits)
    assert scales.dtype == zeros.dtype == dtype, (dtype, scales.dtype, zeros.dtype)
    assert qweight.dtype == torch.int32 and g_idx.dtype == torch.int32
    assert qweight.stride(-1) == 1 and scales.stride(-1) == 1 and g_idx.stride(-1) == 1
    assert zeros.shape == scales.shape and zeros.stride() == scales.stride()
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    assert g_idx.shape == (k,) and scales.shape[1] == n, (
        f"qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, g_idx "
        f"{tuple(g_idx.shape)} at {bits} bits")
    assert perm is None or (perm.shape == (k,) and perm.dtype == torch.int32)
    assert qweight.shape[0] * qweight.stride(0) < 2**31 and scales.numel() < 2**31
    return pack, k, n


def _numerics(dtype: torch.dtype, device: torch.device, offset: bool) -> dict:
    """The dequantization's constexprs: fp16 by the codes' bits (``MAGIC``) only with
    integer zero points; float offsets (``OFFSET``) in float32, their products rounded on
    their own (2) where float32 scales on CUDA would otherwise be fused into the add (off
    CUDA the interpreter rounds each step; 16-bit scales give exact products)."""
    exact = dtype != torch.float32 or device.type != "cuda"
    return {"MAGIC": dtype == torch.float16 and not offset,
            "ROUND_BF16": dtype == torch.bfloat16 and device.type != "cuda",
            "OFFSET": (1 if exact else 2) if offset else 0}


def _code_pairs(kind: str, block_m: int, dtype: torch.dtype, device: torch.device,
                offset: bool, scales: int) -> bool:
    """``PAIRS``: launch kind "wna16p" turns codes into weights two at a time by PTX
    (``_gemv_pairs_step``) where it applies, the fp16 GEMV on CUDA with integer zero points
    and scales per step or packed row; elsewhere (the interpreter included) the launch runs
    as "wna16", with the same numerics."""
    return (kind == "wna16p" and block_m == 1 and dtype == torch.float16 and not offset
            and device.type == "cuda" and scales != 2)


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor, bits: int, perm: torch.Tensor | None = None,
                     runs: tuple[int, int] | None = None, rows: int = 16,
                     block_n: int = 256, out: torch.Tensor | None = None,
                     offset: bool = False) -> torch.Tensor:
    """The weight ``W [K, N]`` in ``scales``' dtype, rows in the checkpoint's column order
    (``perm``): ``quant.wna16.dequantize`` (transposed, unsorted; ``offset`` as there) bit
    for bit; written into ``out`` (``[K, N]``, contiguous rows) when given."""
    pack, k, n = _check_operands(qweight, scales, zeros, g_idx, bits, scales.dtype, perm)
    if out is None:
        w = torch.empty((k, n), dtype=scales.dtype, device=qweight.device)
    else:
        assert out.shape == (k, n) and out.dtype == scales.dtype and out.stride(-1) == 1
        w = out
    mode = scale_mode(runs, rows * pack, pack)
    first, size = runs or (0, 1)
    _wna16_dequant_kernel[(triton.cdiv(k // pack, rows), triton.cdiv(n, block_n))](
        qweight, scales, zeros, g_idx, perm if perm is not None else g_idx, w, n, k, first,
        size, qweight.stride(0), scales.stride(0), w.stride(0), BITS=bits, SCALES=mode,
        HAS_PERM=perm is not None, ROWS=rows, BLOCK_N=block_n,
        **_numerics(scales.dtype, qweight.device, offset), enable_fp_fusion=FP_FUSION, num_warps=4)
    return w


def _dequantized_product(x, qweight, scales, zeros, g_idx, bits, bias, perm, runs,
                         chunk: int, offset: bool) -> torch.Tensor:
    """``x W (+ bias)`` through the dequantized weight: whole (``chunk`` 0), or ``chunk``
    output columns at a time through one ``[K, chunk]`` scratch, each chunk's product
    written into its columns of the output (cuBLAS with the output's leading dimension):
    a scratch that fits in L2 is read back from there rather than from HBM."""
    n = qweight.shape[1]
    if not chunk or chunk >= n:
        w = wna16_dequantize(qweight, scales, zeros, g_idx, bits, perm, runs, offset=offset)
        return torch.addmm(bias, x, w) if bias is not None else x @ w
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    scratch = torch.empty((g_idx.numel(), chunk), dtype=x.dtype, device=x.device)
    for n0 in range(0, n, chunk):
        cols = slice(n0, min(n, n0 + chunk))
        w = wna16_dequantize(qweight[:, cols], scales[:, cols], zeros[:, cols], g_idx, bits,
                             perm, runs, out=scratch[:, :cols.stop - n0], offset=offset)
        if bias is not None:
            torch.addmm(bias[cols], x, w, out=y[:, cols])
        else:
            torch.mm(x, w, out=y[:, cols])
    return y


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, config: WoConfig | str | None = None,
                 perm: torch.Tensor | None = None, runs: tuple[int, int] | None = None,
                 offset: bool = False) -> torch.Tensor:
    """``x [M, K]`` (fp16 / bf16 / fp32, contiguous rows) times the WNA16 weight in the
    served layout (``qweight`` int32 ``[K // pack, N]``, ``scales`` and ``zeros`` ``[G, N]``
    in x's dtype, ``g_idx`` int32 ``[K]``, ``perm`` int32 ``[K]`` or None, all with
    contiguous rows; ``runs`` as ``wna16.consecutive_groups`` reads ``g_idx``, or None),
    plus ``bias [N]``: ``[M, N]`` in x's dtype, ``quant.wna16.linear`` up to float32
    summation order (``offset``: ``zeros`` are float offsets, ``W = q * s + z``, GGUF's
    ``Q4_1``). ``config`` (a ``WoConfig`` of kind "wna16", "wna16t" or "wna16p", its
    string, or "dequant"; split 0: ``fill_split``) overrides ``wna16_blocks`` (benchmarks,
    tests). Shapes alone
    choose the launch, and every buffer is a ``torch.empty`` of a static size: capturable
    in CUDA graphs."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous rows"
    pack, k, n = _check_operands(qweight, scales, zeros, g_idx, bits, x.dtype, perm)
    m = x.shape[0]
    assert x.shape[1] == k, f"x {tuple(x.shape)} against {k} input columns"
    if config is None:
        cfg = default_launch(m, n, k, _sm_count(x.device), x.dtype, x.device, offset, runs,
                             pack)
    elif config == "dequant":
        cfg = DEQUANT
    else:
        cfg = WoConfig.parse(config) if isinstance(config, str) else config
        if cfg.kind not in ("wna16", "wna16t", "wna16p", "dequant"):
            raise ValueError(f"not a wna16 launch: {cfg}")
    if cfg.kind == "dequant":
        return _dequantized_product(x, qweight, scales, zeros, g_idx, bits, bias, perm, runs,
                                    cfg.block_n, offset)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    assert bk >= 16 and bk & (bk - 1) == 0, f"K steps of {bk} columns: a power of two from 16"
    assert cfg.kind != "wna16t" or bm >= 16, "a transposed product needs 16-row tiles or more"
    if perm is not None and bm > 1:
        # the activations in served column order, one gather for the call: through perm in
        # the tile loop every step's [BLOCK_M, BLOCK_K] load is uncoalesced (round 31:
        # 2.5x the product's time at 16 rows, 9x at 64); the GEMV's [BLOCK_K] is not
        x, perm = x.index_select(1, perm), None
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = cfg.split or fill_split(m_tiles * n_tiles, k, bk, _sm_count(x.device), bm)
    split, k_chunk, even_k, part = split_k(split, m, n, k, bk, y)
    dot_dtype, precision = dot_config(x.dtype, x.device)
    first, size = runs or (0, 1)
    scales_mode = scale_mode(runs, bk, pack)
    _wna16_kernel[(m_tiles, n_tiles, split)](
        x, qweight, scales, zeros, g_idx, perm if perm is not None else g_idx,
        bias if bias is not None else scales, y, part, m, n, k, k_chunk, first, size,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, SCALES=scales_mode, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, EVEN_K=even_k, PARTIAL=split > 1,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, SWAP=cfg.kind == "wna16t",
        PAIRS=_code_pairs(cfg.kind, bm, x.dtype, x.device, offset, scales_mode),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        **_numerics(x.dtype, x.device, offset), enable_fp_fusion=FP_FUSION, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    reduce_splits(part, None, bias, y, split)
    return y

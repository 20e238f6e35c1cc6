"""The WNA16 GEMM as Triton kernels (``--quantization gptq`` / ``awq`` /
``compressed-tensors``): integer weights (4 or 8 bits, packed along K) with float group
scales and zero points, activations in fp16 / bf16 / fp32. See ``model/quant/wna16.py`` for
the served layout (``perm``, ``runs``) and the torch reference ``linear``.

Numerics: every weight is the reference's ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]``
(``g = g_idx[k]``) rounded once to the activation dtype: in float32 and then rounded (bf16,
fp32; ``ROUND_BF16``: by bit arithmetic first, off CUDA, where Triton 3.9's interpreter
truncates float32 -> bf16 casts), or for fp16 in fp16 itself (``MAGIC``): the code's bits
OR-ed into the mantissa of 1024.0 give ``1024 + q`` exactly, and the zero points are
integers (the served layout's contract), so ``(1024 + q) - (1024 + z)`` is exact in fp16
and the one multiplication by ``s`` rounds once, as the reference's cast does: no integer
to float conversion, the kernel's costliest step at decode. With ``OFFSET`` (float offsets
after the scale, GGUF's ``Q4_1``) ``q * s + z`` in float32, the product and the sum each
rounded as the reference rounds them, then the cast, in every dtype: a 16-bit scale has at
most 11 significant bits and a code 8, so the product is exact and a fused multiply-add
rounds once, as the reference's two steps do; a float32 scale can have 24 bits, so on CUDA
(``OFFSET`` 2) the product is rounded on its own (``libdevice.mul_rn``, which the compiler
does not fuse into the add). Products go through ``tl.dot`` into
float32; the bias is added to the K-complete float32 sum; the output rounded once. So each
product is the reference's up to float32 summation order and the output's rounding.

Two paths, chosen by M and the dtype (``wna16_blocks``, static: CUDA graphs capture either):
- the fused GEMM (``_wna16_kernel``, M up to ``DEQUANT_MIN_M - 1``): each program
  dequantizes its weight tile in registers. A K step loads ``BLOCK_K / pack`` packed rows
  once, shifts every word by each code's offset into ``[BLOCK_K / pack, PACK, BLOCK_N]``
  (column ``pack * r + j`` at ``(r, j)``) and multiplies the contiguous activation columns
  ``k0 .. k0 + BLOCK_K`` (through ``perm`` when the served columns are sorted): one
  ``tl.dot`` of ``BLOCK_K`` columns a step, or at one activation row (``BLOCK_M`` 1) a GEMV
  on the CUDA cores. Scales and zero points:
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
from triton.language.extra import libdevice

from tpserve.model.kernels.triton_fp8 import (
    WoConfig,
    _sm_count,
    _wo_epilogue,
    reduce_splits,
    split_k,
)
from tpserve.model.kernels.triton_support import FP_FUSION, dot_config
from tpserve.model.quant.wna16 import DEQUANT_MIN_M, pack_factor

DEQUANT = WoConfig("dequant", 0, 0, 0, 1, 0)


def fill_split(tiles: int, k: int, block_k: int, sms: int, block_m: int = 16) -> int:
    """The K split for ``tiles`` output tiles of ``block_m`` rows: enough programs for four
    per SM (the H100 sweeps of round 31: 5-20 % faster than two), at most one per two
    ``block_k`` steps of K (``triton_fp8.auto_split`` allows one per four, which leaves a
    tp-8 shard at decode, 8 tiles of 512 x 4096, on 64 of 132 SMs; here 128); the one-row
    GEMV at most one per step (its 128-column tiles leave a tp-8 shard of 768 x 4096 six)."""
    steps = k // block_k if block_m == 1 else k // (2 * block_k)
    return max(1, min(triton.cdiv(4 * sms, tiles), steps))


def wna16_blocks(m: int, n: int, k: int, sms: int, dtype: torch.dtype) -> WoConfig:
    """The launch (a ``WoConfig``: kind "wna16", its ``split`` resolved by ``fill_split``;
    or ``DEQUANT``) for a static ``(M, N, K)`` on ``sms`` SMs, from the CUDA-graph-timed
    sweeps of ``bench/time_wna16.py`` on an H100 (round 31, llama3-8b shapes, 4-bit): one
    row the GEMV over 128-column tiles (4.5-6x faster than over 64 columns, 1.3x the
    16-row dot); up to 16 rows 16 x 64 tiles; up to ``DEQUANT_MIN_M - 1`` rows 64 x 128
    tiles (4 warps: 8 were 5-10 % slower, 128-row tiles 15-60 %); all over 128-column K
    steps, K split to fill the SMs. float32 activations keep 16 x 64 tiles above 16 rows:
    their products run on the CUDA cores (``ieee``), so larger tiles gain nothing, and a 64
    x 128 tile with per-column groups needs 238,080 bytes of shared memory, over an H100's
    232,448 (round 31: the launch was refused). From ``DEQUANT_MIN_M`` the dequantized
    weight times cuBLAS."""
    if m >= DEQUANT_MIN_M:
        return DEQUANT
    if m == 1:
        cfg = WoConfig("wna16", 1, 128, 128, 0, 4, 3)
    elif m <= 16 or dtype == torch.float32:
        cfg = WoConfig("wna16", 16, 64, 128, 0, 4, 3)
    else:
        cfg = WoConfig("wna16", 64, 128, 128, 0, 4, 3)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return cfg._replace(split=fill_split(tiles, k, cfg.block_k, sms, cfg.block_m))


def scale_mode(runs: tuple[int, int] | None, block_k: int, pack: int) -> int:
    """``SCALES`` for groups ``runs`` (``(first, size)``: ``g_idx == first + k // size``;
    None: any order) under K steps of ``block_k`` columns."""
    if runs is None:
        return 2
    return 0 if runs[1] % block_k == 0 else 1 if runs[1] % pack == 0 else 2


@triton.jit
def _round_bf16(w):
    """float32 ``w`` rounded to the nearest bf16 (ties to even), as float32 (finite ``w``):
    the interpreter's float32 -> bf16 cast truncates (triton 3.9), the GPU's rounds."""
    b = w.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _dequant(q, s, z, MAGIC: tl.constexpr, ROUND_BF16: tl.constexpr, OFFSET: tl.constexpr,
             act_dtype: tl.constexpr):
    """Codes ``q`` (int32, below ``2^BITS``) as ``(q - z) * s`` (``OFFSET`` 1: float
    offsets, ``q * s + z``; 2: the product rounded before the add) rounded to
    ``act_dtype`` (``s``, ``z`` broadcastable to ``q``: with ``MAGIC`` fp16 and ``z``
    already ``1024 + z``, else float32)."""
    if MAGIC:  # 1024 + q by its bits; minus 1024 + z exact (integer zeros), times s rounds
        w = ((q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - z) * s
    else:
        if OFFSET == 2:  # not fused into a multiply-add: rounded as the reference rounds it
            w = libdevice.mul_rn(q.to(tl.float32), s) + z
        elif OFFSET:
            w = q.to(tl.float32) * s + z
        else:
            w = (q.to(tl.float32) - z) * s
        if ROUND_BF16:
            w = _round_bf16(w)  # then the cast below is exact
        w = w.to(act_dtype)
    return w


@triton.jit
def _load_groups(s_ptr, z_ptr, sz, ok, MAGIC: tl.constexpr):
    """The scales and zero points at offsets ``sz``: fp16 with ``1024 + z`` (``MAGIC``;
    exact, an integer below 1024), else float32."""
    s = tl.load(s_ptr + sz, mask=ok, other=0.0)
    z = tl.load(z_ptr + sz, mask=ok, other=0.0)
    # one return: Triton compiles the statements after a constexpr branch that returns
    # too, and refuses the two return types (fp16 and float32) it then sees
    if MAGIC:
        z = z + 1024.0
    else:
        s, z = s.to(tl.float32), z.to(tl.float32)
    return s, z


@triton.jit
def _group_rows(s_ptr, z_ptr, rows, k0, rn, row_ok, n_ok, K, FIRST, GROUP_SIZE, stride_s,
                PACK: tl.constexpr, SCALES: tl.constexpr, MAGIC: tl.constexpr):
    """Scales and zero points of a step (``SCALES`` 0: ``[1, BLOCK_N]``; 1: ``[ROWS,
    BLOCK_N]``, one per packed row; 2: placeholders, ``_code`` gathers them per column)."""
    if SCALES == 2:  # tensors, not constants: what a jit function returns
        s = tl.zeros((1, 1), tl.float32)
        z = tl.zeros((1, 1), tl.float32)
    else:
        if SCALES == 0:
            sz = (FIRST + k0 // GROUP_SIZE) * stride_s + rn[None, :]
            ok = (n_ok & (rn * 0 + k0 < K))[None, :]
        else:
            sz = (FIRST + (rows * PACK) // GROUP_SIZE)[:, None] * stride_s + rn[None, :]
            ok = row_ok[:, None] & n_ok[None, :]
        s, z = _load_groups(s_ptr, z_ptr, sz, ok, MAGIC)
    return s, z


@triton.jit
def _column_groups(s_ptr, z_ptr, g_ptr, kk, rn, row_ok, n_ok, stride_s, MAGIC: tl.constexpr):
    """Scales and zero points of the columns ``kk`` (``SCALES`` 2): ``[ROWS, BLOCK_N]``."""
    g = tl.load(g_ptr + kk, mask=row_ok, other=0)
    sz = g[:, None] * stride_s + rn[None, :]
    ok = row_ok[:, None] & n_ok[None, :]
    return _load_groups(s_ptr, z_ptr, sz, ok, MAGIC)


@triton.jit
def _code(packed, j: tl.constexpr, s, z, rows, rn, row_ok, n_ok, s_ptr, z_ptr, g_ptr,
          perm_ptr, stride_s, BITS: tl.constexpr, SCALES: tl.constexpr,
          HAS_PERM: tl.constexpr, MAGIC: tl.constexpr, ROUND_BF16: tl.constexpr,
          OFFSET: tl.constexpr, act_dtype: tl.constexpr):
    """Code ``j`` of the packed rows ``rows``, both kernels' inner step: ``(w, kk)``, the
    weights ``[ROWS, BLOCK_N]`` in ``act_dtype`` and the checkpoint columns they multiply
    (served columns ``PACK * r + j``, through ``perm`` with ``HAS_PERM``). ``s``, ``z``:
    the step's scale rows (``SCALES`` 0 / 1); with ``SCALES`` 2 they are gathered here."""
    kk = rows * (32 // BITS) + j
    if SCALES == 2:
        s, z = _column_groups(s_ptr, z_ptr, g_ptr, kk, rn, row_ok, n_ok, stride_s, MAGIC)
    w = _dequant((packed >> (j * BITS)) & ((1 << BITS) - 1), s, z, MAGIC, ROUND_BF16,
                 OFFSET, act_dtype)
    if HAS_PERM:
        kk = tl.load(perm_ptr + kk, mask=row_ok, other=0)
    return w, kk


@triton.jit
def _packed_rows(q_ptr, k0, rn, n_ok, K, stride_q, PACK: tl.constexpr, ROWS: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """The K step's ``ROWS`` packed rows from ``k0 / PACK`` of columns ``rn``: ``(rows,
    row_ok, packed)``, rows past K (and columns past N) loaded as 0."""
    rows = k0 // PACK + tl.arange(0, ROWS)
    if EVEN_K:
        row_ok = rows >= 0
        w_ok = n_ok[None, :]
    else:
        row_ok = rows < K // PACK
        w_ok = row_ok[:, None] & n_ok[None, :]
    packed = tl.load(q_ptr + rows[:, None] * stride_q + rn[None, :], mask=w_ok, other=0)
    return rows, row_ok, packed


# Two codes of a packed word as an fp16 pair in one 32-bit operation: ``(w >> shift) & mask
# | 0x6400_6400`` (lop3) puts code j in the low half and code j + PACK/2 in the high half,
# each ``1024 + q`` exactly; then ``((1024 + q) - (1024 + z)) * s`` as f16x2, exact and
# rounded once, the MAGIC path's numerics for two weights an instruction.
_PAIR_MASK = {4: "0x000F000F", 8: "0x00FF00FF"}


def _pairs_asm(bits: int) -> str:
    """PTX: packed word ``$P`` (``P = PACK``), scale ``$(P+1)`` and ``1024 + z``
    ``$(P+2)`` (fp16) -> the ``PACK`` weights ``$0 .. $(P-1)`` (fp16), code order."""
    pack, half = 32 // bits, 16 // bits
    lines = [f"mov.b32 s2, {{${pack + 1}, ${pack + 1}}};",
             f"mov.b32 z2, {{${pack + 2}, ${pack + 2}}};"]
    for j in range(half):
        src = f"${pack}" if j == 0 else "t"
        if j:
            lines.append(f"shr.u32 t, ${pack}, {j * bits};")
        lines += [f"lop3.b32 p, {src}, {_PAIR_MASK[bits]}, 0x64006400, 0xEA;",
                  "sub.f16x2 p, p, z2;", "mul.f16x2 p, p, s2;",
                  f"mov.b32 {{${j}, ${j + half}}}, p;"]
    return "{\n.reg .b32 t, p, s2, z2;\n" + "\n".join(lines) + "\n}"


PAIRS_ASM_4 = tl.constexpr(_pairs_asm(4))  # constants a jit function may read
PAIRS_ASM_8 = tl.constexpr(_pairs_asm(8))


@triton.jit
def _gemv_pairs_step(acc_rows, x_row, q_ptr, s_ptr, z_ptr, perm_ptr, k0, rn, n_ok, K, FIRST,
                     GROUP_SIZE, stride_q, stride_s, BITS: tl.constexpr,
                     SCALES: tl.constexpr, EVEN_K: tl.constexpr, HAS_PERM: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """One K step of the fp16 GEMV with code pairs (launch kind "wna16p", CUDA): each
    packed word becomes its ``PACK`` weights by ``_pairs_asm`` (2 weights an f16x2
    operation), and code ``j`` of the ``ROWS`` packed rows multiplies activation columns
    ``k0 + PACK * r + j`` into ``acc_rows [ROWS, BLOCK_N]`` (float32). Scales per step or
    per packed row (``SCALES`` 0 / 1). Rows past K: activation 0."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    rows, row_ok, packed = _packed_rows(q_ptr, k0, rn, n_ok, K, stride_q, PACK, ROWS, EVEN_K)
    s, z = _group_rows(s_ptr, z_ptr, rows, k0, rn, row_ok, n_ok, K, FIRST, GROUP_SIZE,
                       stride_s, PACK, SCALES, True)
    s = tl.broadcast_to(s, (ROWS, BLOCK_N))
    z = tl.broadcast_to(z, (ROWS, BLOCK_N))
    if BITS == 4:
        w = tl.inline_asm_elementwise(PAIRS_ASM_4, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                                      [packed, s, z], dtype=(tl.float16,) * 8, is_pure=True,
                                      pack=1)
    else:
        w = tl.inline_asm_elementwise(PAIRS_ASM_8, "=h,=h,=h,=h,r,h,h", [packed, s, z],
                                      dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    for j in tl.static_range(PACK):
        kk = k0 + tl.arange(0, ROWS) * PACK + j
        x_ok = kk < K
        if HAS_PERM:
            kk = tl.load(perm_ptr + kk, mask=x_ok, other=0)
        x = tl.load(x_row + kk, mask=x_ok, other=0.0)
        acc_rows += x.to(tl.float32)[:, None] * w[j].to(tl.float32)
    return acc_rows


@triton.jit
def _step_weights(q_ptr, s_ptr, z_ptr, g_ptr, k0, rn, n_ok, K, FIRST, GROUP_SIZE, stride_q,
                  stride_s, BITS: tl.constexpr, SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                  MAGIC: tl.constexpr, ROUND_BF16: tl.constexpr, OFFSET: tl.constexpr,
                  act_dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fused kernel's weights for served columns ``k0 .. k0 + BLOCK_K``: ``[ROWS, PACK,
    BLOCK_N]`` in ``act_dtype``, element ``(r, j, n)`` the weight of column ``k0 + PACK * r
    + j`` (code ``j`` of packed row ``k0 / PACK + r``), so a row-major reshape to
    ``[BLOCK_K, BLOCK_N]`` puts the columns in order. Each packed word is loaded once; rows
    past K give 0 (code 0, scale 0)."""
    PACK: tl.constexpr = 32 // BITS
    ROWS: tl.constexpr = BLOCK_K // PACK
    jj = tl.arange(0, PACK)
    rows, row_ok, packed = _packed_rows(q_ptr, k0, rn, n_ok, K, stride_q, PACK, ROWS, EVEN_K)
    q = (packed[:, None, :] >> (jj * BITS)[None, :, None]) & ((1 << BITS) - 1)
    if SCALES == 2:  # a group per column, through g_idx
        g = tl.load(g_ptr + rows[:, None] * PACK + jj[None, :], mask=row_ok[:, None], other=0)
        s, z = _load_groups(s_ptr, z_ptr, g[:, :, None] * stride_s + rn[None, None, :],
                            row_ok[:, None, None] & n_ok[None, None, :], MAGIC)
    else:  # a row a step ([1, BLOCK_N]) or a row a packed row ([ROWS, BLOCK_N])
        s, z = _group_rows(s_ptr, z_ptr, rows, k0, rn, row_ok, n_ok, K, FIRST, GROUP_SIZE,
                           stride_s, PACK, SCALES, MAGIC)
        s, z = s[:, None, :], z[:, None, :]
    return _dequant(q, s, z, MAGIC, ROUND_BF16, OFFSET, act_dtype)


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
        cfg = wna16_blocks(m, n, k, _sm_count(x.device), x.dtype)
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

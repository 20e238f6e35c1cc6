"""How the WNA16 kernels (``triton_wna16.py``) turn packed integer codes into weights
inside a program: the K step's packed rows, their scales and zero points (per step, per
packed row or per column), and the dequantization itself, tile by tile (``_step_weights``,
the fused GEMM's), code by code (``_code``, the dequantizing kernel's) or, in the fp16
GEMV on CUDA, two codes an instruction by inline PTX (``_gemv_pairs_step``).

Every weight is the reference's ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]``
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
does not fuse into the add).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


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

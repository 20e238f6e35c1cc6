"""Triton kernels of ``--quantization fp8`` (see ``model/quant/fp8.py`` for the scheme and
the torch references ``quantize_per_row`` / ``reference_weight_only``).

- ``quantize_per_token``: one program per row; pass 1 the row's amax, pass 2 scale and
  cast. Bit-exact to ``quantize_per_row``: the divisions are correctly rounded
  (``div_rn``) and the cast rounds to nearest even with the values pre-clamped to +-448.
  The cast is the GPU's own conversion, or (``bit_cast``, the default off CUDA) integer
  arithmetic on the float32 bits, ``_e4m3_code``: Triton 3.9's CPU interpreter converts
  float32 -> e4m3 wrongly (ties away from even, and a mantissa that rounds up past 1.111b
  loses its carry into the exponent: 0.0302 -> 0.0156), so the interpreter never runs its
  cast. Loads (e4m3 -> float32) are right in the interpreter and used as they are.
- ``weight_only_linear``: ``y = (x @ widen(q_w)^T) * s_w + b``, a tiled GEMM whose weight
  tiles are loaded as fp8 (half the bytes of bf16) and widened in registers; float32
  accumulation; the per-channel scale applied once to the accumulator.

Both launch with shapes only (no host synchronisation), so they are captured in CUDA
graphs; their block sizes depend on the static M, N, K alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_support import dot_config

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_SCALE = 1e-12


@triton.jit
def _e4m3_code(v):
    """float32 ``v`` in [-448, 448] -> its e4m3fn byte, rounded to nearest even.

    Normal range (|v| >= 2^-6): keep the float32 exponent and top 3 mantissa bits, adding
    half a unit minus one plus the kept lowest bit first (round half to even; a carry out
    of the mantissa increments the exponent, as it should), then rebias the exponent
    (127 -> 7: minus 120 << 3). Subnormals (|v| < 2^-6, steps of 2^-9): |v| * 512 rounded
    to an integer by the float32 adder itself (adding 2^23 leaves the rounded integer in
    the low mantissa bits); 8 there is 2^-6, the smallest normal code, so both meet."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    small = (tl.abs(v) * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(mag < 0x3C800000, small, normal)  # 0x3C800000 is 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                            FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                            BIT_CAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        o = k0 + cols
        x = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, 0), FP8_MAX_C), MIN_SCALE_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        o = k0 + cols
        x = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        if BIT_CAST:
            code = _e4m3_code(q)
        else:
            code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + row * stride_q + o, code, mask=o < K)


def quantize_per_token(x: torch.Tensor, bit_cast: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last dim contiguous) -> ``(q [M, K] e4m3, scale [M, 1] float32)``.
    ``bit_cast`` (default: off CUDA only) casts by ``_e4m3_code`` instead of the
    hardware conversion."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous rows"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = min(triton.next_power_of_2(k), 2048)
    if bit_cast is None:
        bit_cast = x.device.type != "cuda"
    _quant_per_token_kernel[(m,)](x, q.view(torch.uint8), s, k, x.stride(0), q.stride(0),
                                  FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                  BIT_CAST=bit_cast, BLOCK=block,
                                  num_warps=4 if block <= 1024 else 8)
    return q, s


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                        stride_x, stride_w, stride_y,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_x
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_w  # the [K, N] view of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
        else:
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & (kk[:, None] < K),
                        other=0.0)
        # e4m3 values are exact in bf16, fp16 and fp32: widening loses nothing
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc,
                     input_precision=DOT_PRECISION)
    scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def weight_only_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for a static shape: skinny M streams
    narrow weight tiles (more programs, the weight read once); larger M uses square-ish
    tiles."""
    if m <= 16:
        return 16, 32, 256, 4
    if m <= 64:
        return 64, 64, 128, 4
    return 64, 128, 64, 8


def weight_only_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None,
                       blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``x [M, K]`` (any float dtype, contiguous rows) times ``wq [N, K]`` e4m3 scaled by
    ``w_scale [N]`` float32, plus ``bias [N]``: ``[M, N]`` in x's dtype. ``blocks``
    overrides ``weight_only_blocks`` (benchmarks)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and wq.stride(-1) == 1
    m, k = x.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps = blocks or weight_only_blocks(m, n, k)
    dot_dtype, precision = dot_config(x.dtype, x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _weight_only_kernel[grid](
        x, wq, w_scale, bias if bias is not None else w_scale, y, m, n, k,
        x.stride(0), wq.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y

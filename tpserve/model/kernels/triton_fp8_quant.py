"""The per-token fp8 quantizer of ``--quantization fp8`` (the torch references are
``quantize_per_row`` and ``quantize_static`` in ``model/quant/fp8.py``), and the e4m3
cast the fused producers (``triton_fp8_fused``) share.

``quantize_per_token``: one program per row; pass 1 the row's amax, pass 2 scale and cast
(with a static scale, a checkpoint's ``input_scale``: pass 2 only). Bit-exact to
``quantize_per_row`` on the same device: ``x / scale`` is correctly rounded (``div_rn``;
torch divides by a broadcast tensor exactly too) and the cast rounds to nearest even with
the values pre-clamped to +-448. The scale is the reference's float32 product ``amax *
float32(1/448)`` on every device (a division by 448 is not one formula in torch: ATen on
CUDA multiplies by the reciprocal, the CPU divides, one ulp apart for some amax: the GPU
bit-exact test failures of 18a4c04). The cast is the GPU's own conversion, or (``bit_cast``,
the default off CUDA) integer arithmetic on the float32 bits, ``_e4m3_code``: Triton 3.9's
CPU interpreter converts float32 -> e4m3 wrongly (ties away from even, and a mantissa that
rounds up past 1.111b loses its carry into the exponent: 0.0302 -> 0.0156), so the
interpreter never runs its cast. Loads (e4m3 -> float32) are right in the interpreter and
used as they are.

``quantize_per_group``: the same per group of ``group`` columns of each row (one program a
group), for block-wise FP8 checkpoints.

They launch with shapes only (no host synchronisation), so they are captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_support import FP_FUSION

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_SCALE = 1e-12
# float32(1 / 448), correctly rounded (exact as a Python float)
INV_FP8_MAX = (torch.tensor(1.0, dtype=torch.float32) / FP8_MAX).item()


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
def _quantize_store(v, q_ptr, offs, mask, scale, FP8_MAX_C: tl.constexpr,
                    BIT_CAST: tl.constexpr):
    """Stores the e4m3 codes of float32 ``v / scale`` (clamped, nearest even) at
    ``q_ptr + offs``: the GPU's own cast, or ``_e4m3_code`` (``BIT_CAST``)."""
    q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX_C), FP8_MAX_C)
    if BIT_CAST:
        code = _e4m3_code(q)
    else:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + offs, code, mask=mask)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q,
                            FP8_MAX_C: tl.constexpr, INV_FP8_MAX_C: tl.constexpr,
                            MIN_SCALE_C: tl.constexpr, STATIC: tl.constexpr,
                            BIT_CAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATIC:  # the given scale: no amax pass
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            o = k0 + cols
            x = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) * INV_FP8_MAX_C, MIN_SCALE_C)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        o = k0 + cols
        x = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.0).to(tl.float32)
        _quantize_store(x, q_ptr + row * stride_q, o, o < K, scale, FP8_MAX_C, BIT_CAST)


def quantize_per_token(x: torch.Tensor, bit_cast: bool | None = None,
                       static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (last dim contiguous) -> ``(q [M, K] e4m3, scale [M, 1] float32)``.
    ``static_scale`` (``[1]`` float32 on x's device): every row takes it instead of its own
    (``quantize_static``, one pass, values beyond ``448 * scale`` clipped). ``bit_cast``
    (default: off CUDA only) casts by ``_e4m3_code`` instead of the hardware conversion."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous rows"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    block = min(triton.next_power_of_2(k), 2048)
    if bit_cast is None:
        bit_cast = x.device.type != "cuda"
    static = static_scale is not None
    assert not static or (static_scale.dtype == torch.float32 and static_scale.numel() == 1)
    _quant_per_token_kernel[(m,)](x, q.view(torch.uint8), s, static_scale if static else s,
                                  k, x.stride(0), q.stride(0),
                                  FP8_MAX_C=FP8_MAX, INV_FP8_MAX_C=INV_FP8_MAX,
                                  MIN_SCALE_C=MIN_SCALE, STATIC=static,
                                  BIT_CAST=bit_cast, BLOCK=block,
                                  enable_fp_fusion=FP_FUSION, num_warps=4 if block <= 1024 else 8)
    return q, s


@triton.jit
def _quant_per_group_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s,
                            FP8_MAX_C: tl.constexpr, INV_FP8_MAX_C: tl.constexpr,
                            MIN_SCALE_C: tl.constexpr, BIT_CAST: tl.constexpr,
                            GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    o = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + o, mask=o < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) * INV_FP8_MAX_C, MIN_SCALE_C)
    tl.store(s_ptr + row * stride_s + g, scale)
    _quantize_store(x, q_ptr + row * stride_q, o, o < K, scale, FP8_MAX_C, BIT_CAST)


def quantize_per_group(x: torch.Tensor, group: int, bit_cast: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] e4m3, scale [M, ceil(K / group)] float32)``: each row's
    columns ``[b * group, (b + 1) * group)`` quantized as ``quantize_per_token`` quantizes a
    row (the activations of block-wise FP8 checkpoints; bit-exact to
    ``quant.fp8_block.quantize_per_group``). ``group``: a power of two."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [M, K] with contiguous rows"
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    if bit_cast is None:
        bit_cast = x.device.type != "cuda"
    _quant_per_group_kernel[(m, groups)](x, q.view(torch.uint8), s, k, x.stride(0),
                                         q.stride(0), s.stride(0), FP8_MAX_C=FP8_MAX,
                                         INV_FP8_MAX_C=INV_FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                         BIT_CAST=bit_cast, GROUP=group,
                                         enable_fp_fusion=FP_FUSION, num_warps=4)
    return q, s

"""FP8 (e4m3) KV cache encoding inside Triton kernels (convention: ``model/kv_cache_dtype``).

``quantize_e4m3`` rounds ``x / scale`` onto the e4m3 grid in float32 arithmetic and returns
a float32 that is exactly an e4m3 value, so the final ``.to(float8e4nv)`` is exact on every
target. It does not rely on the cast to round: triton 3.9's CPU interpreter truncates
instead of rounding to nearest even and drops the carry when rounding up crosses a power of
two (124.3 -> 64), so a bare cast cannot be tested on CPU; this formulation is the same code
on the GPU and in the interpreter, and matches torch's cast bit for bit (tested).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize_e4m3(x, scale):
    """``e4m3(clamp(x / scale, -448, 448))`` as float32: round to nearest even, saturating.

    Division is IEEE-rounded (``div_rn``), as torch's. Normal e4m3 values have 3 fraction
    bits, so the grid step at ``|y|`` in ``[2^e, 2^(e+1))`` is ``2^(e-3)``; subnormals share
    ``e = -6``. Adding and subtracting ``c = 1.5 * 2^(e-3+23)`` rounds ``|y|`` to that step
    (``|y| < 2^(e+1)``, so ``c + |y|`` keeps the step as its last bit). The sign bit is copied
    from ``y``, so -0 and tiny negatives give -0, as torch does.
    """
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    a = tl.abs(y)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    c = ((e + 147) << 23).to(tl.float32, bitcast=True) * 1.5  # 2^(e - 3 + 23) * 1.5
    r = (a + c) - c  # >= 0
    # the sign bit copied from y (on the H200, `-r` gave +0 for -0: a subtraction from 0)
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, scale, CACHE_DTYPE: tl.constexpr, KV_FP8: tl.constexpr):
    """``x`` as the cache stores it: FP8 scaled by ``scale`` (a float32 scalar) and
    saturated, other dtypes rounded (``scale`` then unused)."""
    if KV_FP8:
        x = quantize_e4m3(x, scale)
    return x.to(CACHE_DTYPE)

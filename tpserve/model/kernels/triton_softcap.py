"""The attention logit softcap (Gemma 2's ``attn_logit_softcapping`` c) as both attention
kernels apply it: on scores already in the log2 domain (``qk * scale * log2(e)``), with the
cap passed as the constexpr ``SOFTCAP = c log2(e)`` (0: off, and the kernels' code is as
without it), ``SOFTCAP tanh(s / SOFTCAP)`` is ``log2(e)`` times the capped true logit
``c tanh(qk scale / c)``."""

from __future__ import annotations

import triton
import triton.language as tl

from tpserve.model.kernels.torch_ops import check_softcap

LOG2E = 1.4426950408889634


def softcap_constexpr(softcap: float | None) -> float:
    """A launch's ``SOFTCAP``: 0.0 without a cap, else ``c log2(e)`` (ValueError unless
    the cap is None or a finite number > 0: ``torch_ops.check_softcap``)."""
    check_softcap(softcap)
    return 0.0 if softcap is None else softcap * LOG2E


@triton.jit
def cap_logits(s, CAP: tl.constexpr):
    """``CAP * tanh(s / CAP)`` of float32 scores ``s``. Triton has no portable tanh: below
    |x| = 0.625 Cephes' tanhf (an odd polynomial: no cancellation near 0), above it
    ``(1 - e^-2|x|) / (1 + e^-2|x|)`` (no overflow); at most 1.8e-7 relative off float64's
    tanh (numpy, float32 arithmetic)."""
    x = s * (1.0 / CAP)
    a = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
              + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x
    t = tl.exp2(a * -2.8853900817779268)  # e^-2|x|
    large = (1.0 - t) / (1.0 + t)
    large = tl.where(x < 0, -large, large)
    return CAP * tl.where(a < 0.625, small, large)

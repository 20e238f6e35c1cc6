"""SwiGLU gate, ``silu(gate) * up``, and GeGLU's, ``gelu_tanh(gate) * up`` (Gemma), as
Triton kernels (same semantics as torch_ops).

Layout: ``x`` is ``[..., 2 * D]`` = ``[gate | up]`` along the last dimension, viewed as rows;
the output is ``[..., D]`` in ``x.dtype``. The grid is ``(rows, cdiv(D, BLOCK))``. As in the
reference, the gate's activation is computed in float32 and rounded to the input dtype
before the multiply by ``up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpserve.model.kernels.triton_support import FP_FUSION

_BLOCK = 1024


@triton.jit
def _silu_mul_cols(x_row, offs, mask, d):
    """``silu(gate) * up`` of columns ``offs`` of one ``[gate | up]`` row in float32, the
    gate's ``silu`` rounded to the input dtype first (before the output's rounding)."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + d + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return act * up


@triton.jit
def _gelu_tanh_mul_cols(x_row, offs, mask, d):
    """``gelu_tanh(gate) * up`` of columns ``offs``, as ``_silu_mul_cols``: GeLU's tanh
    form ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, tanh written through exp
    (``tanh(u) = 1 - 2 / (exp(2u) + 1)``, exact at both saturations)."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + d + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    act = (0.5 * g * (1.0 + t)).to(gate.dtype).to(tl.float32)
    return act * up


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr,
                        GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    if GELU_TANH:
        y = _gelu_tanh_mul_cols(x_ptr + row * stride_x, offs, mask, d)
    else:
        y = _silu_mul_cols(x_ptr + row * stride_x, offs, mask, d)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gate_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x = [gate | up]`` as contiguous rows ``[rows, 2D]``, and ``D``."""
    two_d = x.shape[-1]
    assert two_d % 2 == 0, f"last dimension must be even, got {two_d}"
    x2 = x.reshape(-1, two_d)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), two_d // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    return _act_and_mul(x, gelu_tanh=True)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    x2, d = gate_rows(x)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _act_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
            enable_fp_fusion=FP_FUSION, num_warps=4)
    return out

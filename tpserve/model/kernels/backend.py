"""The op back-end (norms, activation), chosen once at start-up: Triton on CUDA when
available, the torch reference ops otherwise (``resolve_kernel_backend`` turns
``--kernel-backend auto`` into one of them when the config tree is built). Attention
(RoPE + KV write, paged attention) is the attention back-end's (``model.attention``),
chosen by the same name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

KERNEL_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Ops:
    """The ops; the ``*_fp8`` variants also quantize their output per token for a W8A8
    layer (``quant.fp8.Fp8Activation``'s fields: codes, scales, dtype; the add variant
    returns the residual sum after them). The norms take ``unit_offset`` (Gemma's
    ``1 + w``); ``gelu_tanh_and_mul`` is Gemma's gate (no fp8 variant: a Gemma W8A8
    layer quantizes its own input); ``grouped_mm(a, w, ends)`` a mixture of experts'
    product of rows grouped by expert with each expert's ``[N, K]`` weight."""

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rms_norm_fp8: Callable
    add_rms_norm_fp8: Callable
    silu_and_mul_fp8: Callable
    gelu_tanh_and_mul: Callable
    grouped_mm: Callable


def _ops_from(module_name: str, name: str) -> Ops:
    m = importlib.import_module(module_name)
    return Ops(name, m.rms_norm, m.add_rms_norm, m.silu_and_mul, m.rms_norm_fp8,
               m.add_rms_norm_fp8, m.silu_and_mul_fp8, m.gelu_tanh_and_mul, m.grouped_mm)


def resolve_kernel_backend(name: str, device_type: str) -> str:
    """``auto``: Triton on CUDA (if importable), torch otherwise."""
    if name == "auto":
        triton = device_type == "cuda" and importlib.util.find_spec("triton") is not None
        return "triton" if triton else "torch"
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"unknown --kernel-backend {name!r}; choose auto, "
                         f"{', '.join(KERNEL_BACKENDS)}")
    return name


def select_ops(backend: str) -> Ops:
    """The ops of a resolved back-end name (``KERNEL_BACKENDS``)."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel back-end {backend!r}; choose one of "
                         f"{KERNEL_BACKENDS}")
    if backend == "triton":
        return _ops_from("tpserve.model.kernels.triton_ops", "triton")
    return _ops_from("tpserve.model.kernels.torch_ops", "torch")

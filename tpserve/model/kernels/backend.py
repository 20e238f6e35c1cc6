"""The op back-end (norms, activation), chosen once at start-up: Triton on CUDA when
available, the torch reference ops otherwise (``resolve_kernel_backend`` turns
``--kernel-backend auto`` into one of them when the config tree is built). Attention
(RoPE + KV write, paged attention) is the attention back-end's (``model.attention``),
chosen by the same name."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

KERNEL_BACKENDS = ("torch", "triton")
PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol (programmatic dependent launch): sm_90 and later


@dataclass(frozen=True)
class Ops:
    """The ops; the ``*_fp8`` variants also quantize their output per token for a W8A8
    layer (``quant.fp8.Fp8Activation``'s fields: codes, scales, dtype; the add variant
    returns the residual sum after them)."""

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rms_norm_fp8: Callable
    add_rms_norm_fp8: Callable
    silu_and_mul_fp8: Callable


def _ops_from(module_name: str, name: str, **bound) -> Ops:
    m = importlib.import_module(module_name)
    fns = (m.rms_norm, m.add_rms_norm, m.silu_and_mul, m.rms_norm_fp8, m.add_rms_norm_fp8,
           m.silu_and_mul_fp8)
    return Ops(name, *(functools.partial(f, **bound) if bound else f for f in fns))


def resolve_kernel_backend(name: str, device_type: str) -> str:
    """``auto``: Triton on CUDA (if importable), torch otherwise."""
    if name == "auto":
        triton = device_type == "cuda" and importlib.util.find_spec("triton") is not None
        return "triton" if triton else "torch"
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"unknown --kernel-backend {name!r}; choose auto, "
                         f"{', '.join(KERNEL_BACKENDS)}")
    return name


def resolve_pdl(asked: bool, backend: str, device: torch.device) -> bool:
    """``--pdl`` made concrete: the Triton kernels launch with programmatic dependent
    launch (``triton_pdl``) when asked for, on a CUDA device of compute capability >= 9.0."""
    return (asked and backend == "triton" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY)


def select_ops(backend: str, pdl: bool = False) -> Ops:
    """The ops of a resolved back-end name (``KERNEL_BACKENDS``); ``pdl`` (resolved for the
    device: ``triton_pdl.pdl_supported``): the Triton ops launch with programmatic dependent
    launch."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel back-end {backend!r}; choose one of "
                         f"{KERNEL_BACKENDS}")
    if backend == "triton":
        return _ops_from("tpserve.model.kernels.triton_ops", "triton",
                         **({"pdl": True} if pdl else {}))
    return _ops_from("tpserve.model.kernels.torch_ops", "torch")

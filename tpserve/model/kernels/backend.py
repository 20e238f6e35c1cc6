"""The op back-end (norms, activation, RoPE + KV write, paged attention), chosen once at
start-up: Triton on CUDA when available, the torch reference ops otherwise."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable
    rope_and_write_kv: Callable
    paged_attention: Callable


def _ops_from(module_name: str, name: str) -> Ops:
    m = importlib.import_module(module_name)
    return Ops(name, m.rms_norm, m.add_rms_norm, m.silu_and_mul, m.rope_and_write_kv,
               m.paged_attention)


def select_ops(device: torch.device, backend: str = "auto") -> Ops:
    """``auto``: Triton on CUDA (if importable), torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel back-end {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        backend = "torch"
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            backend = "triton"
    if backend == "triton":
        return _ops_from("tpserve.model.kernels.triton_ops", "triton")
    return _ops_from("tpserve.model.kernels.torch_ops", "torch")

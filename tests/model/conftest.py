"""Fixtures shared by the Triton kernel test modules of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernels():
    """The triton_* modules, built for Triton's interpreter on a machine without CUDA
    (``test_triton_kernels`` sets ``TRITON_INTERPRET=1`` when it is imported, and re-imports
    kernel modules that were built before)."""
    from tests.model import test_triton_kernels as tk

    with pytest.MonkeyPatch.context() as mp:
        if tk.DEVICE.type == "cpu":
            tk._fix_interpreter_index(mp)
        yield tk._kernel_modules()


@pytest.fixture(scope="module")
def backend(kernels):
    """The Triton attention back-end's module (it reaches the kernels through ``kernels``)."""
    from tpserve.model.attention import triton_backend

    return triton_backend

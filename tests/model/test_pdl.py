"""Programmatic dependent launch (``--pdl``, ``kernels/triton_pdl.py``): how the flag is
resolved, and that every op of the bundle and the fp8 method hands it to its kernels. On a
GPU of compute capability >= 9.0 ``test_cuda_graph_path`` checks that captured steps give
the same logits, bit for bit, with and without it."""

from __future__ import annotations

import pytest
import torch

from tpserve.model.kernels.backend import resolve_pdl, select_ops


def test_pdl_is_on_by_default_and_off_with_no_pdl():
    from tpserve.cli import build_parser
    from tpserve.server.config import config_from_args

    parser, _ = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).runner.pdl is True
    assert config_from_args(parser.parse_args(["serve", "--no-pdl"])).runner.pdl is False


def test_pdl_resolves_off_without_triton_or_a_hopper_gpu():
    """Asked for, it still needs the Triton kernels and a CUDA device of compute capability
    >= 9.0; the CPU (the interpreter) never gets it."""
    cpu = torch.device("cpu")
    assert resolve_pdl(True, "triton", cpu) is False
    assert resolve_pdl(True, "torch", cpu) is False
    assert resolve_pdl(False, "triton", cpu) is False
    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        hopper = torch.cuda.get_device_capability(gpu) >= (9, 0)
        assert resolve_pdl(True, "triton", gpu) is hopper
        assert resolve_pdl(True, "torch", gpu) is False
        assert resolve_pdl(False, "triton", gpu) is False


@pytest.mark.parametrize("pdl", [False, True])
def test_the_op_bundle_binds_the_flag_to_every_triton_op(pdl):
    """Each Triton op takes ``pdl`` and the bundle passes the resolved value to all six; the
    torch ops never see it."""
    import inspect

    ops = select_ops("triton", pdl)
    names = ("rms_norm", "add_rms_norm", "silu_and_mul", "rms_norm_fp8", "add_rms_norm_fp8",
             "silu_and_mul_fp8")
    for name in names:
        fn = getattr(ops, name)
        bound = getattr(fn, "keywords", {})
        assert bound.get("pdl", False) is pdl, name
        target = getattr(fn, "func", fn)
        assert inspect.signature(target).parameters["pdl"].default is False, name
    torch_ops = select_ops("torch", pdl)
    assert all(not hasattr(getattr(torch_ops, n), "keywords") for n in names)


def test_the_fp8_method_and_attention_backend_carry_the_flag():
    from tpserve.model.attention.backend import select_attention
    from tpserve.model.quant.methods import linear_method

    cpu = torch.device("cpu")
    for pdl in (False, True):
        method = linear_method("fp8", "triton", cpu, torch.bfloat16, 32, pdl=pdl)
        assert method.pdl is pdl
        assert select_attention("triton", torch.bfloat16, pdl).pdl is pdl
    assert linear_method("fp8", "triton", cpu, torch.bfloat16, 32).pdl is False

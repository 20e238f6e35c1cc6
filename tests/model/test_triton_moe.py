"""The Triton grouped product of a mixture of experts' layers (``triton_moe.grouped_mm``)
against the torch ops' ``torch._grouped_mm`` (float32, on CPU) in float16, bf16 and
float32: groups of every size around the row tile (0, 1, 15, 16, 17, 40 rows), experts no
row chose (first, last, in between), one expert holding every row, a single row, and the
tile sizes of small and large steps; widths not a multiple of the tiles. On CPU under
``TRITON_INTERPRET=1`` (``test_triton_kernels``, imported first), on CUDA compiled; and a
whole expert layer (``ParallelExperts``) on the Triton ops equals the torch ops'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.test_triton_kernels import ATOL, DEVICE, DTYPES
from tpserve.model.kernels import torch_ops

triton = pytest.importorskip("triton")

GROUPS = {"sizes_around_the_tile": [0, 1, 15, 16, 17, 0, 40, 0],
          "one_expert": [0, 0, 0, 33, 0, 0, 0, 0],
          "one_row": [0, 0, 0, 0, 0, 0, 0, 1],
          "large": [300, 0, 129, 64, 1, 0, 7, 100]}


def _reference(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` in float32 on CPU (the torch ops' path)."""
    return torch_ops.grouped_mm(a.float().cpu(), w.float().cpu(), ends.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", list(GROUPS))
def test_grouped_mm_equals_torch(kernels, dtype, groups):
    gen = torch.Generator().manual_seed(11)
    sizes = GROUPS[groups]
    rows, n, k = sum(sizes), 72, 136  # neither a multiple of the column or K tiles
    a = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype=dtype, device=DEVICE)
    w = torch.randn(len(sizes), n, k, generator=gen).to(dtype=dtype, device=DEVICE)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    got = kernels["triton_moe"].grouped_mm(a, w, ends)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = ATOL[dtype] * 4
    torch.testing.assert_close(got.float().cpu(), _reference(a, w, ends), atol=tol, rtol=tol)


def test_an_expert_layer_on_the_triton_ops_equals_the_torch_ops(kernels):
    from tpserve.model.layers.moe import route
    from tpserve.parallel.comm import Communicator
    from tpserve.parallel.moe import ParallelExperts
    from tpserve.parallel.state import TPGroup

    gen = torch.Generator().manual_seed(12)
    comm = Communicator(TPGroup(0, 1, DEVICE, None))
    experts = ParallelExperts(8, 64, 40, comm, torch.float32).to(DEVICE)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) / 8)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) / 8)
    x = torch.randn(21, 64, generator=gen).to(DEVICE)
    weights, ids = route(torch.randn(21, 8, generator=gen).to(DEVICE), 3, True)

    def silu_and_mul(h):
        return F.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:]

    got = experts(x, ids, weights, silu_and_mul, kernels["triton_moe"].grouped_mm)
    want = experts.cpu()(x.cpu(), ids.cpu(), weights.cpu(), silu_and_mul,
                         torch_ops.grouped_mm)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups", ["sizes_around_the_tile", "large"])
def test_grouped_mm_of_fp8_experts_equals_torch(kernels, dtype, groups):
    """Weight-only fp8 experts (``--quantization fp8``): e4m3 codes with a scale per expert
    and output row give the product with the dequantized weights."""
    from tpserve.model.quant.fp8 import quantize_per_row

    gen = torch.Generator().manual_seed(13)
    sizes = GROUPS[groups]
    e, n, k = len(sizes), 40, 96
    q, scale = quantize_per_row(torch.randn(e * n, k, generator=gen))
    w, scale = q.view(e, n, k).to(DEVICE), scale.view(e, n).to(DEVICE)
    a = (torch.randn(sum(sizes), k, generator=gen) / k**0.5).to(dtype=dtype, device=DEVICE)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    got = kernels["triton_moe"].grouped_mm(a, w, ends, scale)
    want = torch_ops.grouped_mm(a.float().cpu(), w.cpu(), ends.cpu(), scale.cpu())
    tol = ATOL[dtype] * 4
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the torch ops' CUDA path for dtypes "
                                                   "torch._grouped_mm does not take")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_torch_ops_grouped_mm_on_cuda_in_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(14)
    sizes = GROUPS["sizes_around_the_tile"]
    a = (torch.randn(sum(sizes), 136, generator=gen) / 136**0.5).to(dtype)
    w = torch.randn(len(sizes), 72, 136, generator=gen).to(dtype)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = torch_ops.grouped_mm(a.to(DEVICE), w.to(DEVICE), ends.to(DEVICE))
    tol = ATOL[dtype] * 4
    torch.testing.assert_close(got.float().cpu(), _reference(a, w, ends), atol=tol, rtol=tol)


@pytest.mark.parametrize("launch", [(16, 32, 128, 4), (64, 256, 64, 8), (128, 128, 64, 8)])
def test_other_launches_give_the_same_product(kernels, launch):
    """The benchmark's tiles (``bench/time_moe.py``'s sweep) compute the same product."""
    gen = torch.Generator().manual_seed(15)
    sizes = GROUPS["large"]
    a = (torch.randn(sum(sizes), 136, generator=gen) / 136**0.5).to(DEVICE)
    w = torch.randn(len(sizes), 72, 136, generator=gen).to(DEVICE)
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    got = kernels["triton_moe"].grouped_mm(a, w, ends, None, launch)
    torch.testing.assert_close(got.cpu(), _reference(a, w, ends), atol=4e-4, rtol=4e-4)


def test_large_bf16_steps_go_to_cutlass():
    """The measured split (``CUTLASS_ROWS_PER_EXPERT``): above 64 routed rows per expert,
    unscaled bf16 on CUDA takes ``torch._grouped_mm``; fp8 experts, other dtypes and the
    CPU never do."""
    from tpserve.model.kernels.triton_moe import uses_cutlass

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not uses_cutlass(128 * 64, 128, torch.bfloat16, cuda, False)
    assert uses_cutlass(128 * 64 + 1, 128, torch.bfloat16, cuda, False)
    assert uses_cutlass(8 * 2048, 8, torch.bfloat16, cuda, False)
    assert not uses_cutlass(8 * 2048, 8, torch.bfloat16, cuda, True)
    assert not uses_cutlass(8 * 2048, 8, torch.float16, cuda, False)
    assert not uses_cutlass(8 * 2048, 8, torch.bfloat16, cpu, False)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="captures a CUDA graph: GPU only")
def test_the_cutlass_path_replays_in_a_cuda_graph(kernels):
    """A step large enough for ``torch._grouped_mm`` (bf16, 80 rows per expert), captured
    in a CUDA graph with new routing written into its inputs before the replay, equals the
    CPU reference of that routing."""
    gen = torch.Generator().manual_seed(16)
    e, rows = 8, 8 * 80
    a = (torch.randn(rows, 136, generator=gen) / 136**0.5).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(e, 72, 136, generator=gen).to(torch.bfloat16).to(DEVICE)
    ends = torch.full((e,), 80, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    mm = kernels["triton_moe"]
    assert mm.uses_cutlass(rows, e, a.dtype, a.device, False)
    mm.grouped_mm(a, w, ends)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm.grouped_mm(a, w, ends)
    sizes = torch.tensor([0, 200, 40, 0, 100, 100, 1, 199], dtype=torch.int32)
    ends.copy_(sizes.cumsum(0, dtype=torch.int32))
    a.copy_((torch.randn(rows, 136, generator=gen) / 136**0.5).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(a, w, ends)
    torch.testing.assert_close(out.float().cpu(), want, atol=ATOL[torch.bfloat16] * 4,
                               rtol=ATOL[torch.bfloat16] * 4)

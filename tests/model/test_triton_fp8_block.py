"""The block-wise fp8 Triton kernels (``kernels/triton_fp8_block.py``, the group quantizer
in ``kernels/triton_fp8_quant.py``) against their torch references
(``model/quant/fp8_block.py``). Off CUDA they run in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before the kernel modules are imported); on the GPU the same
tests run compiled, the W8A8 product through the FP8 tensor cores."""

from __future__ import annotations

import os
import sys

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tests.model.test_triton_kernels import interpreted_modules  # noqa: E402
from tpserve.model.quant.fp8 import FP8, MIN_SCALE, quantize_per_row  # noqa: E402
from tpserve.model.quant.fp8_block import (  # noqa: E402
    block_mm_supported,
    cublas_block_product,
    quantize_per_group,
    reference_block_quantized,
    reference_block_w8a8,
    reference_block_weight_only,
)

NAMES = (("tpserve.model.kernels.triton_fp8_quant", "_quant_per_group_kernel"),
         ("tpserve.model.kernels.triton_fp8", "_wo_gemv_kernel"),
         ("tpserve.model.kernels.triton_fp8_block", "_block_kernel"))


@pytest.fixture(scope="module")
def kern():
    """The block GEMM module, with the quantizer and weight-only modules it uses,
    interpreted off CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        yield interpreted_modules(mp, NAMES, DEVICE.type == "cpu")[-1]


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)  # groups of all sizes
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,group", [(3, 200, 16), (5, 256, 128), (2, 40, 32)])
def test_quantize_per_group_is_bit_exact(kern, dtype, m, k, group):
    quant = sys.modules[NAMES[0][0]]
    x = _rows(m, k, dtype, 1)
    x[1, :group] = 0  # a zero group: zero codes, the minimum scale
    q, s = quant.quantize_per_group(x, group)
    want_q, want_s = quantize_per_group(x.cpu(), group)
    assert q.dtype == FP8 and s.shape == (m, -(-k // group))
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
    assert s[1, 0] == MIN_SCALE  # (compared in float32)


def _block_weight(n: int, k: int, bn: int, bk: int, seed: int, shared: bool):
    """Codes ``[N, K]`` and block scales: ``[ceil(N / bn), groups]`` (``shared``) or one row
    of scales per weight row; zero codes in row 1 (a padding row). The scales are a view
    of rows with NaN beyond the last group (and a NaN row after the last): a kernel that
    reads a scale outside the weight's groups returns NaN."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[1] = 0
    q, _ = quantize_per_row(w)
    rows, groups = (-(-n // bn) if shared else n), -(-k // bk)
    padded = torch.full((rows + 1, groups + 3), float("nan"))
    padded[:rows, :groups] = torch.rand(rows, groups, generator=g) * 2 + 0.01
    scale = padded.to(DEVICE)[:rows, :groups]
    return q.to(DEVICE), scale, bn if shared else 1


@pytest.mark.parametrize("quantize_input", [True, False], ids=["w8a8", "weight-only"])
# K split over 2 programs at (1, 96, 1024), over 4 of 5, 5, 5, 3 groups at (3, 300, 2304)
# (test_decode_sizes_split_the_groups_over_programs)
@pytest.mark.parametrize("m,n,k", [(1, 96, 1024), (3, 300, 2304), (20, 200, 130),
                                   (70, 64, 512)])
@pytest.mark.parametrize("shared", [True, False], ids=["per-block", "per-row"])
def test_block_linear_matches_its_reference(kern, quantize_input, m, n, k, shared):
    """float32 activations: the kernel's float32 sums against the reference's, to float32
    summation order (bf16 on the GPU: one rounding of the output); bias on, tails in M, N
    and K (K 130: a two-column last group), K split over programs where the tiles are
    few, the padding row exactly the bias."""
    bk = 128 if k != 130 else 64
    dtype = torch.bfloat16 if DEVICE.type == "cuda" and quantize_input else torch.float32
    x = _rows(m, k, dtype, 2)
    wq, ws, rows = _block_weight(n, k, 8, bk, 3, shared)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    y = kern.block_linear(x, wq, ws, rows, bk, bias, quantize_input)
    ref = reference_block_w8a8 if quantize_input else reference_block_weight_only
    want = ref(x.float().cpu(), wq.cpu(), ws.cpu(), rows, bk, bias.cpu()).float()
    assert y.shape == (m, n) and y.dtype == dtype
    tol = (2**-7 if dtype == torch.bfloat16 else 1e-5) * want.abs().max()
    assert (y.float().cpu() - want).abs().max() <= tol
    assert torch.equal(y[:, 1].float().cpu(), bias[1].to(dtype).float().cpu().expand(m))


def test_decode_sizes_split_the_groups_over_programs(kern):
    """Fewer output tiles than SMs (decode sizes): the K groups go to up to three programs
    an SM, at least eight groups each; a grid of at least one tile an SM is not split."""
    assert kern.tiles(1, 96, 8, 132) == (16, 64, 1)  # 8 groups: no split
    assert kern.tiles(3, 300, 18, 132) == (16, 64, 2)
    assert kern.tiles(1, 4096, 32, 132) == (16, 64, 4)  # o at M = 1: 64 tiles, 4 splits
    # Llama-3-8B at 64 tokens: qkv 96 tiles, 4 splits; down 64 tiles, 6 splits (of 112
    # groups); gate_up 224 tiles of 128 columns, not split
    assert kern.tiles(64, 6144, 32, 132) == (64, 64, 4)
    assert kern.tiles(64, 4096, 112, 132) == (64, 64, 6)
    assert kern.tiles(64, 28672, 32, 132) == (64, 128, 1)
    assert kern.tiles(16, 132 * 64, 64, 132) == (16, 64, 1)  # one tile an SM
    assert kern.tiles(512, 28672, 32, 132) == (128, 128, 1)


def test_tuned_weight_only_launches_take_block_scales(kern):
    """Decode steps' products take ``triton_fp8``'s tuned weight-only launches with the
    block scales in their K loop: the GEMVs (M <= 2) as tuned, their tiles of 4 and 32
    rows inside one 128-row scale block; per-row scales leave the GEMVs to the block
    kernel; the dots' steps cut to one group (or the largest power of two dividing it)."""
    fp8 = sys.modules[NAMES[1][0]]
    wo = fp8.weight_only_blocks
    for m in (1, 2):
        assert fp8.block_launch(wo(m, 6144, 4096), 128, 128) == wo(m, 6144, 4096)
        assert fp8.block_launch(wo(m, 6144, 4096), 1, 128) is None
    assert wo(8, 6144, 4096).block_k == 256
    assert fp8.block_launch(wo(8, 6144, 4096), 128, 128) == wo(8, 6144, 4096)._replace(
        block_k=128)
    assert fp8.block_launch(wo(8, 6144, 4096), 1, 96).block_k == 32
    assert fp8.block_launch(wo(24, 6144, 4096), 1, 128) == wo(24, 6144, 4096)


# K 640: a masked last step; 2048 (M = 1) and 1024 (M = 2): whole steps only
@pytest.mark.parametrize("m,k", [(1, 640), (1, 2048), (2, 1024)])
def test_block_gate_up_gemv_gates_in_its_epilogue(kern, m, k):
    """The merged gate/up GEMV with block scales and the SiLU gate in one kernel equals
    ``silu(g) * u`` of the block-dequantized product (float32; bias on); no fused launch
    where one block of scale rows would span the gate and up halves."""
    fp8 = sys.modules[NAMES[1][0]]
    half = 64
    x = _rows(m, k, torch.float32, 5)
    wq, ws, rows = _block_weight(2 * half, k, 32, 128, 6, True)
    bias = torch.randn(2 * half, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    y = fp8.weight_only_silu_mul(x, wq, ws, bias, (rows, 128))
    gu = reference_block_weight_only(x.cpu(), wq.cpu(), ws.cpu(), rows, 128, bias.cpu())
    want = torch.nn.functional.silu(gu[:, :half]) * gu[:, half:]
    assert y is not None and y.shape == (m, half)
    assert (y.cpu() - want).abs().max() <= 1e-5 * want.abs().max()
    wq, ws, rows = _block_weight(2 * half, k, 128, 128, 6, True)  # one block: both halves
    assert fp8.weight_only_silu_mul(x, wq, ws, bias, (rows, 128)) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="cuBLAS's block scaling: GPU only")
def test_cublas_block_product_matches_its_reference():
    """W8A8 steps above 64 tokens take cuBLAS's block scaling where the GPU has it (Hopper:
    checked there): the group-quantized product of the reference, to one bf16 rounding
    of the output, bias added."""
    if torch.cuda.get_device_capability(DEVICE) == (9, 0):
        assert block_mm_supported(DEVICE)
    if not block_mm_supported(DEVICE):
        pytest.skip("this GPU's torch has no 1 x 128 / 128 x 128 block scaling")
    x = _rows(80, 512, torch.bfloat16, 8)
    xq, xs = quantize_per_group(x, 128)
    wq, ws, rows = _block_weight(256, 512, 128, 128, 9, True)
    ws = ws.contiguous()  # as loaded
    bias = torch.randn(256, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    y = cublas_block_product(xq, xs, wq, ws, bias.bfloat16(), torch.bfloat16)
    want = reference_block_quantized(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), rows, 128,
                                     bias.cpu(), torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (80, 256)
    assert (y.float().cpu() - want).abs().max() <= 2**-7 * want.abs().max()


# 20 rows in 16- and 32-row tiles, 5 groups split 1, 2 (3 + 2 groups) and 5 ways
@pytest.mark.parametrize("launch", ["16,64,1,4,3", "32,128,2,8,2", "16,32,5,4,3"])
def test_any_block_launch_gives_the_product(kern, launch):
    """``block_gemm`` with a launch other than ``tiles``' (a benchmark's sweep) computes the
    same W8A8 product: against the reference to float32 summation order."""
    x = _rows(20, 640, torch.float32, 11)
    wq, ws, rows = _block_weight(200, 640, 8, 128, 12, True)
    y = kern.block_gemm(x, wq, ws, rows, 128, None, True,
                        launch=kern.BlockLaunch.parse(launch))
    want = reference_block_w8a8(x.cpu(), wq.cpu(), ws.cpu(), rows, 128, None)
    assert (y.cpu() - want).abs().max() <= 1e-5 * want.abs().max()

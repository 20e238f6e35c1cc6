"""The Triton W8A8 fp8 GEMM (``kernels/triton_w8a8.py``) against the product of the
dequantized operands, and its choice inside ``Fp8LinearMethod``.

On a machine without CUDA the kernel runs in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before the kernel modules are imported); on the GPU the same
tests run compiled with fp8 tensor-core products.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tests.model.test_triton_kernels import interpreted_modules  # noqa: E402
from tpserve.model.quant.fp8 import quantize_per_row  # noqa: E402

NAMES = (("tpserve.model.kernels.triton_fp8_quant", "_quant_per_token_kernel"),
         ("tpserve.model.kernels.triton_fp8", "_wo_load"),
         ("tpserve.model.kernels.triton_w8a8", "_w8a8_kernel"))


@pytest.fixture(scope="module")
def kern():
    """The W8A8 module, with the fp8 module it builds on, interpreted off CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        yield interpreted_modules(mp, NAMES, DEVICE.type == "cpu")[-1]


def _operands(m: int, n: int, k: int, seed: int, zero_rows=(), zero_cols=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]
    x[list(zero_rows)] = 0
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[list(zero_cols)] = 0
    xq, xs = quantize_per_row(x)
    wq, ws = quantize_per_row(w)
    return xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.view(-1).to(DEVICE)


# Hopper's fp8 tensor cores keep about 14 bits of a running sum (the kernel adds each
# K step into float32): on CUDA the bound allows 2^-12 of sum |x w| for that
MMA_ROUNDING = 2**-12 if DEVICE.type == "cuda" else 0.0


# with fast accumulation a whole K chunk stays in the tensor cores' accumulator: the bound
# of cuBLAS's use_fast_accum (test_scaled_mm_steps_above_the_triton_bound_equal_the_reference)
FAST_ROUNDING = 2**-8 if DEVICE.type == "cuda" else 0.0


def _check(kern, xq, xs, wq, ws, bias, out_dtype, config=None, fast_accum=False):
    """Against the float32 product of the dequantized operands: float32 outputs to the
    summation-order bound (plus the fp8 tensor cores' rounding on CUDA), 16-bit outputs
    to one rounding of the output dtype more."""
    y = kern.w8a8_linear(xq, xs, wq, ws, bias, out_dtype, config, fast_accum)
    xd, wd = xq.float() * xs, wq.float() * ws[:, None]
    want = F.linear(xd, wd, None if bias is None else bias.float())
    assert y.dtype == out_dtype and y.shape == (xq.shape[0], wq.shape[0])
    mag = F.linear(xd.abs(), wd.abs())
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    acc = FAST_ROUNDING if fast_accum else MMA_ROUNDING
    tol = eps * want.abs() + ((xq.shape[1] + 4) * 2**-24 + acc) * mag + 1e-30
    assert ((y.float() - want).abs() <= tol).all(), (y.float() - want).abs().max()
    return y


# the shipped table, then explicit launches: split and unsplit, M/N/K tails of every block
CONFIGS = [None, "w8a8,16,16,32,1,4,1", "w8a8,16,32,64,2,4,2", "w8a8,32,16,32,3,4,1",
           "w8a8,32,32,32,0,4,2"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 96), (33, 24, 160), (20, 72, 200)])
def test_w8a8_launches_match_the_dequantized_product(kern, config, m, n, k):
    """Every launch at M = 1..33, N tails (40, 72), K not a multiple of the block (200) or
    of the split, a zero activation row and zero weight rows, with and without bias."""
    xq, xs, wq, ws = _operands(m, n, k, 1, zero_rows=(m // 2,), zero_cols=(0, n - 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for b in (None, bias):
        y = _check(kern, xq, xs, wq, ws, b, torch.float32, config)
        # a zero row gives exactly the bias; a zero weight row gives exactly its bias
        want_row = torch.zeros(n, device=DEVICE) if b is None else b
        assert torch.equal(y[m // 2], want_row)
        col = torch.zeros(m, device=DEVICE) if b is None else b[0].expand(m)
        assert torch.equal(y[:, 0], col)


@pytest.mark.parametrize("config", [None, "w8a8,64,64,256,0,4,5", "w8a8,16,32,64,2,4,2"])
def test_w8a8_fast_accumulation_matches_the_dequantized_product(kern, config):
    """``fast_accum`` (``--fp8-fast-accum``): over K = 2,048 in one or two chunks, with the
    fast table's launches (None: 64 x 32 x 256 at this size) and a small split one, the
    product is within the tensor cores' own accumulation bound of the reference; off CUDA
    (the interpreter's exact widened dot) it is the promoted kernel's result bit for bit."""
    xq, xs, wq, ws = _operands(33, 40, 2048, 6, zero_rows=(7,))
    y = _check(kern, xq, xs, wq, ws, None, torch.bfloat16, config, fast_accum=True)
    assert torch.equal(y[7], torch.zeros(40, dtype=y.dtype, device=DEVICE))
    if DEVICE.type == "cpu":
        assert torch.equal(y, kern.w8a8_linear(xq, xs, wq, ws, None, torch.bfloat16, config))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_w8a8_rounds_once_into_16_bit_outputs(kern, out_dtype):
    xq, xs, wq, ws = _operands(70, 136, 64, 3)
    _check(kern, xq, xs, wq, ws, None, out_dtype)


def test_w8a8_refuses_unquantized_operands_and_other_launch_kinds(kern):
    xq, xs, wq, ws = _operands(4, 16, 32, 4)
    with pytest.raises(AssertionError):
        kern.w8a8_linear(xq.float(), xs, wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match="not a w8a8 launch"):
        kern.w8a8_linear(xq, xs, wq, ws, None, torch.float32, "dot,16,16,32,1,4")


@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("m", [33, 64, 65, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (1024, 4096), (4096, 1792)])
def test_w8a8_table_runs_about_one_wave(kern, m, n, k, fast_accum):
    """The static launch table (no kernel run), for the llama3-8b shapes and their tp-8
    shards on an H200's 132 SMs, promoted or with fast accumulation: at most one program
    per SM unless the output tiles alone are more, and no further split fits under one
    wave or K's cap of four steps a chunk."""
    cfg = kern.w8a8_blocks(m, n, k, fast_accum)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split or kern.one_wave_split(tiles, k, cfg.block_k, 132)
    assert cfg.kind == "w8a8"
    assert tiles * split <= 132 or split == 1
    assert tiles * (split + 1) > 132 or split == max(1, k // (4 * cfg.block_k))


@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast-accum"])
def test_fp8_method_takes_the_triton_kernel_for_mid_sized_steps(kern, fast_accum):
    """``Fp8LinearMethod`` (Triton back-end, FP8 products available) at M = 40, above its
    weight-only bound: the per-token quantizer then this kernel, run with the method's
    ``fast_accum``, which equals the reference W8A8 product to the kernel's bound (off
    CUDA: the interpreter)."""
    from tpserve.model.quant.fp8 import Fp8LinearMethod, reference_w8a8

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 64, generator=g)).to(DEVICE)
    w = torch.randn(48, 64, generator=g) / 8
    wq, ws = quantize_per_row(w)
    wq, ws = wq.to(DEVICE), ws.view(-1).to(DEVICE)
    method = Fp8LinearMethod("triton", weight_only_max_tokens=8, scaled_mm=True,
                             fast_accum=fast_accum)
    y = method.matmul(x, wq, ws, None)
    xq, xs = quantize_per_row(x)
    direct = kern.w8a8_linear(xq, xs, wq, ws, None, torch.float32, fast_accum=fast_accum)
    assert torch.equal(y, direct)
    want = reference_w8a8(x, wq, ws, None)
    mag = F.linear((xq.float() * xs).abs(), (wq.float() * ws[:, None]).abs())
    acc = FAST_ROUNDING if fast_accum else MMA_ROUNDING
    assert ((y - want).abs() <= (68 * 2**-24 + acc) * mag + 1e-30).all()


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm needs FP8 matrix products (compute capability "
                           ">= 8.9)")
@pytest.mark.parametrize("fast_accum", [False, True], ids=["promoted", "fast-accum"])
def test_scaled_mm_steps_above_the_triton_bound_equal_the_reference(fast_accum):
    """At M = 128 (past ``w8a8_triton_max_tokens``) the method takes ``torch._scaled_mm``,
    with ``use_fast_accum`` as ``fast_accum`` says; over K = 4096 the product equals the
    reference W8A8 product to bf16 rounding plus the accumulation's bound: promoted sums
    as the Triton kernel's, the tensor cores' own sums (~14 bits kept) 2^-8 of sum |x w|."""
    from tpserve.model.quant.fp8 import Fp8LinearMethod, reference_quantized_product

    xq, xs, wq, ws = _operands(128, 256, 4096, 9)
    method = Fp8LinearMethod("triton", weight_only_max_tokens=8, scaled_mm=True,
                             fast_accum=fast_accum)
    y = method.w8a8(xq, xs, wq, ws, None, torch.bfloat16)
    want = reference_quantized_product(xq, xs, wq, ws, None, torch.float32)
    mag = F.linear((xq.float() * xs).abs(), (wq.float() * ws[:, None]).abs())
    acc = 2**-8 if fast_accum else MMA_ROUNDING
    assert y.dtype == torch.bfloat16 and y.shape == (128, 256)
    assert ((y.float() - want).abs() <= 2**-8 * want.abs() + acc * mag + 1e-30).all()

"""The Triton WNA16 GEMM (``kernels/triton_wna16.py``: GPTQ / AWQ integer weights with
group scales and zero points) against the torch reference ``quant.wna16.linear``.

On a machine without CUDA the kernel runs in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before the kernel modules are imported); on the GPU the same
tests run compiled.
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
from tpserve.model.quant.wna16 import dequantize, linear, pack_rows  # noqa: E402

NAMES = (("tpserve.model.kernels.triton_fp8", "_wo_load"),
         ("tpserve.model.kernels.triton_wna16", "_wna16_kernel"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the spacing of the output dtype relative to a value (one rounding of either side)
ULP = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}
# fp16 / bf16 tensor-core sums keep a little less than float32 (truncated alignment)
MMA_ROUNDING = 2**-20 if DEVICE.type == "cuda" else 0.0


@pytest.fixture(scope="module")
def kern():
    """The WNA16 module, with the fp8 module it builds on, interpreted off CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        yield interpreted_modules(mp, NAMES, DEVICE.type == "cpu")[-1]


def _operands(m: int, n: int, k: int, bits: int, dtype: torch.dtype, seed: int,
              act_order: bool = False, group: int = 32):
    """Random codes, positive scales, float zero points anywhere in the code range, and
    ``g_idx = k // group`` (``act_order``: a random permutation of it), in the served
    layout, with activations ``x [M, K]``."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (k, n), generator=g)
    groups = triton.cdiv(k, group)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    scales = (torch.rand(groups, n, generator=g) + 0.5) * 2 / (2**bits * k**0.5)
    zeros = torch.rand(groups, n, generator=g) * 2**bits
    x = torch.randn(m, k, generator=g)
    return (x.to(dtype).to(DEVICE), pack_rows(codes, bits).to(DEVICE),
            scales.to(dtype).to(DEVICE), zeros.to(dtype).to(DEVICE),
            g_idx.to(torch.int32).to(DEVICE))


def _check(kern, x, qweight, scales, zeros, g_idx, bits, bias=None, config=None):
    """Against the reference in x's dtype: both sides round the same ``W`` and sum in
    float32, so they differ by the two sums' orders (each within ``K * 2^-24`` of
    ``sum |x w|``) and then one rounding of the output dtype."""
    y = kern.wna16_matmul(x, qweight, scales, zeros, g_idx, bits, bias, config)
    want = linear(x, qweight, scales, zeros, g_idx, bits, bias)
    assert y.dtype == x.dtype and y.shape == want.shape
    w = dequantize(qweight, scales, zeros, g_idx, bits).float()
    mag = F.linear(x.float().abs(), w.abs())
    k = x.shape[1]
    tol = (ULP[x.dtype] * want.float().abs() + (2 * k * 2**-24 + MMA_ROUNDING) * mag
           + 1e-30)
    err = (y.float() - want.float()).abs()
    assert (err <= tol).all(), err.max()
    return y


@pytest.mark.parametrize("act_order", [False, True], ids=["grouped", "act-order"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_identity_activations_give_the_dequantized_weight_exactly(kern, bits, dtype,
                                                                  act_order):
    """``x = I``: every output is one product by 1, so ``y = W^T`` bit for bit: the codes'
    shifts, the ``g_idx`` gather and the rounding of ``(q - z) * s`` to x's dtype are the
    reference's (64 rows: the 64-row launch, 24 columns: an N tail)."""
    _, qweight, scales, zeros, g_idx = _operands(1, 24, 64, bits, dtype, 1, act_order)
    x = torch.eye(64, dtype=dtype, device=DEVICE)
    y = kern.wna16_matmul(x, qweight, scales, zeros, g_idx, bits)
    assert torch.equal(y, dequantize(qweight, scales, zeros, g_idx, bits).t())


@pytest.mark.parametrize("act_order", [False, True], ids=["grouped", "act-order"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 72, 192), (5, 24, 64), (33, 72, 192)])
def test_equals_the_dequantized_product(kern, m, n, k, bits, dtype, act_order):
    """The shipped launches at decode (M = 1, 5: 16-row tiles) and above (M = 33: a 64-row
    tile, an M tail), N tails of the 64-column tile, K = 192 a tail of the 128-column
    step, with a bias at M = 5."""
    x, qweight, scales, zeros, g_idx = _operands(m, n, k, bits, dtype, 2, act_order)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
            if m == 5 else None)
    _check(kern, x, qweight, scales, zeros, g_idx, bits, bias)


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_splits_k_over_programs(kern, bits):
    """M = 1, one output tile, K = 1,096 (nine 128-column steps): the shipped launch asks
    for four programs along K, ``split_k`` cuts three chunks of three steps (the last
    ending in a 72-column tail), the float32 partials reduced with the bias after; it
    equals the reference as the unsplit launch does."""
    m, n, k = 1, 24, 1096
    cfg = kern.wna16_blocks(m, n, k, 132)
    assert cfg.split == 4 and kern.split_k(cfg.split, m, n, k, cfg.block_k, torch.empty(m, n))[:3] == (
        3, 384, False)
    x, qweight, scales, zeros, g_idx = _operands(m, n, k, bits, torch.bfloat16, 4, True)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(x).to(DEVICE)
    split = _check(kern, x, qweight, scales, zeros, g_idx, bits, bias)
    whole = _check(kern, x, qweight, scales, zeros, g_idx, bits, bias, cfg._replace(split=1))
    assert (split.float() - whole.float()).abs().max() <= 2**-6 * whole.float().abs().max()


@pytest.mark.parametrize("config", ["wna16,16,16,32,3,4,1", "wna16,32,32,64,0,4,2",
                                    "wna16,16,64,16,1,4,1"])
def test_explicit_launches_mask_every_tail(kern, config):
    """Small tiles over M = 33, N = 72, K = 200 (tails of every block; 200 columns in
    groups of 32 leave a short last group), split in three, auto-split (two ways) and
    unsplit with 16-column steps (two packed words of 4 bits a step)."""
    x, qweight, scales, zeros, g_idx = _operands(33, 72, 200, 4, torch.float32, 6)
    _check(kern, x, qweight, scales, zeros, g_idx, 4, None, config)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_scale_rows_give_exactly_zero_columns(kern, bits):
    """Padding as ``parallel/`` serves it: weight rows with scale 0 (any codes and zeros)
    give exactly 0 output columns, and input columns whose activations are 0 (code 0
    there) change nothing; the other columns equal the reference."""
    x, qweight, scales, zeros, g_idx = _operands(5, 40, 64, bits, torch.bfloat16, 7)
    pad_rows, pad_cols = [3, 38, 39], [60, 61, 62, 63]
    scales[:, pad_rows] = 0
    x[:, pad_cols] = 0
    y = _check(kern, x, qweight, scales, zeros, g_idx, bits)
    assert torch.equal(y[:, pad_rows], torch.zeros(5, 3, dtype=y.dtype, device=DEVICE))
    assert (y[:, :3] != 0).all()


def test_refuses_other_bit_widths_dtypes_and_launch_kinds(kern):
    x, qweight, scales, zeros, g_idx = _operands(2, 16, 32, 4, torch.float16, 8)
    with pytest.raises(ValueError, match="3-bit"):
        kern.wna16_matmul(x, qweight, scales, zeros, g_idx, 3)
    with pytest.raises(AssertionError):
        kern.wna16_matmul(x.float(), qweight, scales, zeros, g_idx, 4)
    with pytest.raises(AssertionError):  # 8-bit codes: 16 columns in those 4 packed rows
        kern.wna16_matmul(x, qweight, scales, zeros, g_idx, 8)
    with pytest.raises(ValueError, match="not a wna16 launch"):
        kern.wna16_matmul(x, qweight, scales, zeros, g_idx, 4, None, "dot,16,16,32,1,4")


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (768, 4096), (512, 4096), (4096, 1792), (3584, 4096)])
def test_decode_launch_fills_an_h100(kern, m, n, k):
    """The static launch table (no kernel run) at decode, for the llama3-8b shapes and
    their tp-8 shards on 132 SMs: the programs (tiles times split) fill at least 90 % of
    the SMs (the smallest shard, 8 tiles of 512 x 4096, runs 128 at its cap of two K
    steps a chunk), and tiles that fill two waves are never split."""
    cfg = kern.wna16_blocks(m, n, k, 132)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    assert cfg.kind == "wna16" and cfg.block_m == 16 and cfg.split >= 1
    assert tiles * cfg.split >= 0.9 * 132
    assert cfg.split == 1 or tiles < 2 * 132


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_the_checkpoint_method_on_the_triton_back_end_equals_the_torch_one(kern, fmt):
    """A row-parallel layer loaded from a GPTQ (act-order) or AWQ checkpoint's tensors:
    ``Wna16Method`` with the Triton back-end multiplies as the torch reference does."""
    from tests.model.int_checkpoints import AWQ_INTERLEAVE, group_indices, pack, quantize
    from tpserve.model.quant.wna16_method import Wna16Method
    from tpserve.parallel.comm import Communicator
    from tpserve.parallel.linear import RowParallelLinear
    from tpserve.parallel.state import TPGroup

    comm = Communicator(TPGroup(0, 1, DEVICE, None))
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    g_idx = group_indices(96, 32, fmt == "gptq", seed=4)
    codes, zeros, scales, _ = quantize(w, g_idx, 4, 1)
    order = None if fmt == "gptq" else AWQ_INTERLEAVE
    tensors = {"qweight": pack(codes, 4, 0) if fmt == "gptq" else pack(codes, 4, 1, order),
               "qzeros": pack(zeros - int(fmt == "gptq"), 4, 1, order), "scales": scales}
    if fmt == "gptq":
        tensors["g_idx"] = g_idx
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = []
    for backend in ("torch", "triton"):
        method = Wna16Method(fmt, 4, 32, int(fmt == "gptq"), backend)
        with torch.device(DEVICE):
            layer = RowParallelLinear(96, 40, comm, dtype=torch.float32, quant_method=method)
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t.to(DEVICE))
        layer.process_weights_after_loading()
        out.append(layer(x))
    assert torch.allclose(out[1], out[0], rtol=1e-5, atol=1e-5)

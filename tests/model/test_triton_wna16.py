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
from tests.model.wna16_operands import LAYOUTS, operands  # noqa: E402
from tpserve.model.quant.wna16 import dequantize, linear  # noqa: E402

NAMES = (("tpserve.model.kernels.triton_fp8", "_wo_load"),
         ("tpserve.model.kernels.triton_wna16_codes", "_step_weights"),
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


def _operands(*args, **kwargs):
    """``wna16_operands.operands`` on this run's device."""
    return operands(*args, device=DEVICE, **kwargs)


def _check(kern, x, qweight, scales, zeros, g_idx, perm, runs, bits, bias=None, config=None,
           offset=False):
    """Against the reference in x's dtype: both sides round the same ``W`` and sum in
    float32, so they differ by the two sums' orders (each within ``K * 2^-24`` of
    ``sum |x w|``) and then one rounding of the output dtype."""
    y = kern.wna16_matmul(x, qweight, scales, zeros, g_idx, bits, bias, config, perm, runs,
                          offset=offset)
    want = linear(x, qweight, scales, zeros, g_idx, bits, bias, perm=perm, offset=offset)
    assert y.dtype == x.dtype and y.shape == want.shape
    w = dequantize(qweight, scales, zeros, g_idx, bits, offset=offset).float()
    xs = x if perm is None else x[:, perm.long()]
    mag = F.linear(xs.float().abs(), w.abs())
    k = x.shape[1]
    tol = (ULP[x.dtype] * want.float().abs() + (2 * k * 2**-24 + MMA_ROUNDING) * mag
           + 1e-30)
    err = (y.float() - want.float()).abs()
    assert (err <= tol).all(), err.max()
    return y


def _weight(qweight, scales, zeros, g_idx, perm, bits):
    """The reference's ``W [N, K]`` in the checkpoint's column order."""
    w = dequantize(qweight, scales, zeros, g_idx, bits)
    return w if perm is None else torch.empty_like(w).index_copy_(1, perm.long(), w)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_identity_activations_give_the_dequantized_weight_exactly(kern, bits, dtype, layout,
                                                                  group):
    """``x = I``: every output is one product by 1, so ``y = W^T`` bit for bit: the codes'
    shifts, the scale rows (per K step with groups of 128, per packed row with 32, per
    column), the sorted columns' ``perm`` and the rounding of ``(q - z) * s`` to x's dtype
    are the reference's (256 rows: the fused 64 x 128 launch (float32: 16 x 64) and the
    dequantized weight times a matmul; and every 17th row through the one-row GEMV, a
    program per row, also with code pairs ("wna16p"); 24 columns: an N tail)."""
    _, *ops = _operands(1, 24, 256, bits, dtype, 1, layout, group)
    x = torch.eye(256, dtype=dtype, device=DEVICE)
    want = _weight(*ops[:4], ops[4], bits).t()
    # float32's 64 x 128 tiles need more shared memory than an H100 gives with per-column
    # groups (wna16_blocks keeps float32 at 16 x 64)
    tile = "wna16,16,64,128,1,4,3" if dtype == torch.float32 else "wna16,64,128,128,1,8,3"
    for config in (tile, None):
        y = kern.wna16_matmul(x, *ops[:4], bits, None, config, *ops[4:])
        assert torch.equal(y, want), config
    for gemv in ("wna16,1,32,128,1,4,3", "wna16p,1,32,128,1,4,3"):  # p: code pairs (fp16)
        y = kern.wna16_matmul(x[::17].contiguous(), *ops[:4], bits, None, gemv, *ops[4:])
        assert torch.equal(y, want[::17]), gemv
    assert torch.equal(kern.wna16_dequantize(*ops[:4], bits, *ops[4:]), want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 72, 384), (5, 24, 256), (33, 72, 384), (170, 40, 256)])
def test_equals_the_dequantized_product(kern, m, n, k, bits, dtype, layout):
    """The shipped launches at decode (M = 1, 5: 16-row tiles), above (M = 33: a 64-row
    tile, an M tail) and from ``DEQUANT_MIN_M`` (M = 170: the dequantized weight times a
    matmul), N tails of the 64-column tile, K = 384 three 128-column steps in groups of
    128 (one scale row a step), with a bias at M = 5 and 170."""
    x, *ops = _operands(m, n, k, bits, dtype, 2, layout, group=128)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
            if m in (5, 170) else None)
    assert (kern.wna16_blocks(m, n, k, 132, torch.float16) == kern.DEQUANT) == (m >= kern.DEQUANT_MIN_M)
    _check(kern, x, *ops[:4], *ops[4:], bits, bias)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_one_row_gemv_equals_the_dequantized_product(kern, bits, dtype, layout):
    """The GEMV launch (``BLOCK_M`` 1: CUDA-core multiply-adds, the pack axis summed each
    step): M = 2 (a program per row), N = 72 (a tail of the 64-column tile), K = 384 in
    three 128-column steps split over two programs (partials reduced with the bias), and
    unsplit over 256-column steps (the last half past K); each also as "wna16p" (fp16 on
    CUDA: codes turned into weights two at a time by PTX; elsewhere the same launch)."""
    x, *ops = _operands(2, 72, 384, bits, dtype, 9, layout, group=128)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    for config in ("wna16,1,64,128,2,4,3", "wna16,1,32,256,1,4,2", "wna16p,1,64,128,2,4,3",
                   "wna16p,1,32,256,1,4,2"):
        _check(kern, x, *ops[:4], *ops[4:], bits, bias, config)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits", [4, 8])
def test_the_dequantized_weight_in_column_chunks(kern, bits, layout):
    """The dequantized path a chunk of output columns at a time (``dequant,0,CHUNK,...``:
    one ``[K, CHUNK]`` scratch, each chunk's product written into its columns of the
    output): N = 40 in chunks of 16, 16 and 8 (a short last chunk), with a bias; each chunk's
    weight is the whole dequantized weight's columns bit for bit (``x = I``)."""
    x, *ops = _operands(170, 40, 256, bits, torch.float32, 10, layout, group=128)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    _check(kern, x, *ops[:4], *ops[4:], bits, bias, "dequant,0,16,0,1,0")
    eye = torch.eye(256, device=DEVICE)
    assert torch.equal(kern.wna16_matmul(eye, *ops[:4], bits, None, "dequant,0,16,0,1,0",
                                         *ops[4:]),
                       _weight(*ops[:4], ops[4], bits).t())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 33, 170])
def test_float_offsets_equal_the_reference(kern, m, dtype):
    """Float offsets after the scale (``offset``, GGUF's ``Q4_1``: ``W = q * s + z``, ``z``
    any float): the GEMV (M = 1), 16-row tiles (5), 64-row tiles (33) and the dequantized
    weight (170) against the reference, 4-bit codes in groups of 32 (a scale row per packed
    row of a K step); with ``x = I`` each output is one weight, bit for bit."""
    x, qweight, scales, zeros, g_idx, perm, runs = _operands(m, 72, 384, 4, dtype, 12)
    zeros = (torch.randn(zeros.shape, generator=torch.Generator().manual_seed(12))
             * scales.float().cpu() * 8).to(dtype).to(DEVICE)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(13)).to(dtype).to(DEVICE)
    _check(kern, x, qweight, scales, zeros, g_idx, perm, runs, 4, bias, offset=True)
    eye = torch.eye(384, dtype=dtype, device=DEVICE)[:m]
    y = kern.wna16_matmul(eye, qweight, scales, zeros, g_idx, 4, None, None, perm, runs,
                          offset=True)
    w = dequantize(qweight, scales, zeros, g_idx, 4, offset=True)
    assert torch.equal(y, w.t()[:m])
    assert not torch.equal(w, dequantize(qweight, scales, zeros, g_idx, 4))


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_splits_k_over_programs(kern, bits):
    """M = 1, one output tile, K = 1,088 (nine 128-column steps, act-order sorted in groups
    of 32): the shipped launch (the GEMV) asks for eight programs along K, one per step,
    ``split_k`` cuts five chunks of two steps (the last a 64-column tail), the float32
    partials reduced with the bias after; it equals the reference as the unsplit launch
    does."""
    m, n, k = 1, 24, 1088
    cfg = kern.wna16_blocks(m, n, k, 132, torch.float16)
    assert cfg.block_m == 1 and cfg.split == 8
    assert kern.split_k(cfg.split, m, n, k, cfg.block_k, torch.empty(m, n))[:3] == (5, 256, False)
    x, *ops = _operands(m, n, k, bits, torch.bfloat16, 4, "act-order")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(x).to(DEVICE)
    split = _check(kern, x, *ops, bits, bias)
    whole = _check(kern, x, *ops, bits, bias, cfg._replace(split=1))
    assert (split.float() - whole.float()).abs().max() <= 2**-6 * whole.float().abs().max()


@pytest.mark.parametrize("config", ["wna16,16,16,128,3,4,1", "wna16,32,32,128,0,4,2",
                                    "wna16,16,64,256,1,4,1", "wna16,1,16,64,3,4,1"])
def test_explicit_launches_mask_every_tail(kern, config):
    """Small tiles over M = 33, N = 72, K = 200 (tails of every block; 200 columns in
    groups of 32 leave a short last group: a scale row per packed row), split in three
    (two chunks: two steps), auto-split and unsplit with one 256-column step, and the
    one-row GEMV over 64-column steps split in three."""
    x, *ops = _operands(33, 72, 200, 4, torch.float32, 6)
    assert ops[-1] == (0, 32)
    _check(kern, x, *ops, 4, None, config)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_transposed_product_equals_the_reference(kern, dtype, layout):
    """Launch kind "wna16t" (``W x^T``: the dequantized tile as the product's first operand)
    over M = 33, N = 72, K = 384 in 16 x 64 tiles split in two and 64 x 128 tiles (tails of
    M and N; 8-bit codes in groups of 32: a scale row per packed row): the reference within
    summation order; with ``x = I`` every output is one weight, bit for bit (float32: 16 x
    64 only, as ``wna16_blocks`` keeps it)."""
    x, *ops = _operands(33, 72, 384, 8, dtype, 14, layout, group=32)
    tiles = ["wna16t,16,64,128,2,4,3"] + (["wna16t,64,128,128,1,4,3"]
                                          if dtype != torch.float32 else [])
    eye = torch.eye(384, dtype=dtype, device=DEVICE)[::7].contiguous()
    want = _weight(*ops[:4], ops[4], 8).t()[::7]
    for config in tiles:
        _check(kern, x, *ops, 8, None, config)
        assert torch.equal(kern.wna16_matmul(eye, *ops[:4], 8, None, config, *ops[4:]), want)
    with pytest.raises(AssertionError, match="16-row tiles"):
        kern.wna16_matmul(x, *ops[:4], 8, None, "wna16t,1,64,128,1,4,3", *ops[4:])


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_scale_rows_give_exactly_zero_columns(kern, bits):
    """Padding as ``parallel/`` serves it: weight rows with scale 0 (any codes and zeros)
    give exactly 0 output columns, and input columns whose activations are 0 (code 0
    there) change nothing; the other columns equal the reference."""
    x, *ops = _operands(5, 40, 64, bits, torch.bfloat16, 7)
    pad_rows, pad_cols = [3, 38, 39], [60, 61, 62, 63]
    ops[1][:, pad_rows] = 0
    x[:, pad_cols] = 0
    y = _check(kern, x, *ops, bits)
    assert torch.equal(y[:, pad_rows], torch.zeros(5, 3, dtype=y.dtype, device=DEVICE))
    assert (y[:, :3] != 0).all()


def test_refuses_other_bit_widths_dtypes_and_launch_kinds(kern):
    x, qweight, scales, zeros, g_idx, _, _ = _operands(2, 16, 32, 4, torch.float16, 8)
    for steps in ("8", "96"):
        with pytest.raises(AssertionError, match="a power of two from 16"):
            kern.wna16_matmul(x, qweight, scales, zeros, g_idx, 4, None,
                              f"wna16,16,16,{steps},1,4")
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
    steps a chunk), and tiles that fill four programs per SM are never split. Above one
    row the transposed 16 x 128 tile where it fills them (rounds 33 and 35), else 16 x
    64."""
    cfg = kern.wna16_blocks(m, n, k, 132, torch.float16)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if m == 1:
        assert cfg[:3] == ("wna16", 1, 128)
    else:
        wide = triton.cdiv(n, 128) * kern.fill_split(triton.cdiv(n, 128), k, 128, 132, 16)
        assert cfg[:3] == (("wna16t", 16, 128) if wide >= 0.9 * 132 else ("wna16", 16, 64))
    assert cfg.split >= 1 and tiles * cfg.split >= 0.9 * 132
    assert cfg.split == 1 or tiles < 4 * 132


@pytest.mark.parametrize("m,dtype", [(2, torch.bfloat16), (32, torch.float16)], ids=str)
def test_the_default_launch_at_2_to_32_rows_is_the_transposed_product(kern, m, dtype):
    """4,096 output columns over 1,024 inputs (4-bit, groups of 128 in column order) at
    2 and 32 rows: the default launch (``config`` None) is the transposed product (16 x 128
    tiles to 16 rows, 32 x 128 above, K split 4 ways on 132 SMs) and equals the reference
    within summation order (the table at 16 and 17 rows:
    ``test_float32_keeps_16_row_tiles_above_16_rows``)."""
    x, *ops = _operands(m, 4096, 1024, 4, dtype, 21, "grouped", group=128)
    sms = kern._sm_count(DEVICE)
    assert sms == 132 or DEVICE.type == "cuda"
    cfg = kern.default_launch(m, 4096, 1024, sms, dtype, DEVICE, False, ops[5], 8)
    assert cfg[:3] == ("wna16t", 16 if m <= 16 else 32, 128)
    _check(kern, x, *ops, 4)


def test_the_one_row_launch_takes_the_code_pairs_where_they_apply(kern):
    """One row: the pairs GEMV over 64-column tiles (round 33 on an H100: 1.1-1.7x the
    plain GEMV) where the code pairs apply (fp16 on CUDA, integer zero points, scales per K
    step or packed row), else the plain GEMV over 128-column tiles; both split K to fill
    the SMs. ``_code_pairs`` says where: never for bf16 / fp32, float offsets, per-column
    scales or off CUDA (there the launch kind runs as the plain GEMV)."""
    pairs = kern.wna16_blocks(1, 4096, 4096, 132, torch.float16, pairs=True)
    plain = kern.wna16_blocks(1, 4096, 4096, 132, torch.float16)
    assert pairs[:4] == ("wna16p", 1, 64, 128) and plain[:4] == ("wna16", 1, 128, 128)
    assert pairs.split >= 1 and plain.split >= 1
    assert kern.wna16_blocks(2, 4096, 4096, 132, torch.float16, pairs=True)[:2] == ("wna16t", 16)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert kern._code_pairs("wna16p", 1, torch.float16, cuda, False, 0)
    assert kern._code_pairs("wna16p", 1, torch.float16, cuda, False, 1)
    for args in ((torch.bfloat16, cuda, False, 0), (torch.float32, cuda, False, 0),
                 (torch.float16, cuda, True, 0), (torch.float16, cuda, False, 2),
                 (torch.float16, cpu, False, 0)):
        assert not kern._code_pairs("wna16p", 1, *args), args


def test_float32_keeps_16_row_tiles_above_16_rows(kern):
    """float32 products run on the CUDA cores (``ieee``): 16 x 64 tiles at 33 rows, where a
    64 x 128 tile with per-column groups needs more shared memory than an H100 gives a block
    (``test_hopper_compile.py`` checks every launch's); fp16 / bf16 take the 64 x 128 tile."""
    assert kern.wna16_blocks(33, 4096, 4096, 132, torch.float32)[:4] == ("wna16", 16, 64, 128)
    for dtype in (torch.float16, torch.bfloat16):
        assert kern.wna16_blocks(33, 4096, 4096, 132, dtype)[:4] == ("wna16", 64, 128, 128)
        # 2-32 rows: the transposed 16 x 128 / 32 x 128 tiles (they fill the SMs here)
        assert kern.wna16_blocks(16, 4096, 4096, 132, dtype)[:4] == ("wna16t", 16, 128, 128)
        assert kern.wna16_blocks(17, 4096, 4096, 132, dtype)[:4] == ("wna16t", 32, 128, 128)
        assert kern.wna16_blocks(32, 4096, 4096, 132, dtype)[:4] == ("wna16t", 32, 128, 128)
    for m in (2, 16, 32):
        assert kern.wna16_blocks(m, 4096, 4096, 132, torch.float32).kind == "wna16"


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

"""The Triton W8A8 fp8 GEMM (``kernels/triton_w8a8.py``) against the product of the
dequantized operands, its split reduced by the last program of each tile (tile counters)
against the reduce kernel, bit for bit, and its choice inside ``Fp8LinearMethod``.

On a machine without CUDA the kernel runs in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before the kernel modules are imported); on the GPU the same
tests run compiled with fp8 tensor-core products.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tests.model.test_triton_kernels import _fix_interpreter_index  # noqa: E402
from tpserve.model.quant.fp8 import quantize_per_row  # noqa: E402

NAMES = ("tpserve.model.kernels.triton_fp8", "tpserve.model.kernels.triton_w8a8")


@pytest.fixture(scope="module")
def kern():
    """The W8A8 module, with the fp8 module it builds on, interpreted off CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            _fix_interpreter_index(mp)
            from triton.runtime.interpreter import InterpretedFunction
            fp8 = sys.modules.get(NAMES[0])
            if fp8 is not None and not isinstance(fp8._wo_load, InterpretedFunction):
                importlib.reload(fp8)
            w8 = sys.modules.get(NAMES[1])
            if w8 is not None and not isinstance(w8._w8a8_kernel, InterpretedFunction):
                importlib.reload(w8)
        importlib.import_module(NAMES[0])
        yield importlib.import_module(NAMES[1])


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


def _check(kern, xq, xs, wq, ws, bias, out_dtype, config=None):
    """Against the float32 product of the dequantized operands: float32 outputs to the
    summation-order bound (plus the fp8 tensor cores' rounding on CUDA), 16-bit outputs
    to one rounding of the output dtype more."""
    y = kern.w8a8_linear(xq, xs, wq, ws, bias, out_dtype, config)
    xd, wd = xq.float() * xs, wq.float() * ws[:, None]
    want = F.linear(xd, wd, None if bias is None else bias.float())
    assert y.dtype == out_dtype and y.shape == (xq.shape[0], wq.shape[0])
    mag = F.linear(xd.abs(), wd.abs())
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    tol = eps * want.abs() + ((xq.shape[1] + 4) * 2**-24 + MMA_ROUNDING) * mag + 1e-30
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


@pytest.mark.parametrize("m", [33, 64, 65, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (1024, 4096), (4096, 1792)])
def test_w8a8_table_runs_about_one_wave(kern, m, n, k):
    """The static launch table (no kernel run), for the llama3-8b shapes and their tp-8
    shards on an H200's 132 SMs: at most one program per SM unless the output tiles alone
    are more, and no further split fits under one wave or K's cap of four steps a chunk."""
    cfg = kern.w8a8_blocks(m, n, k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split or kern.one_wave_split(tiles, k, cfg.block_k, 132)
    assert cfg.kind == "w8a8"
    assert tiles * split <= 132 or split == 1
    assert tiles * (split + 1) > 132 or split == max(1, k // (4 * cfg.block_k))


def test_fp8_method_takes_the_triton_kernel_for_mid_sized_steps(kern):
    """``Fp8LinearMethod`` (Triton back-end, FP8 products available) at M = 40, above its
    weight-only bound: the per-token quantizer then this kernel, which equals the
    reference W8A8 product to the kernel's bound (off CUDA: the interpreter)."""
    from tpserve.model.quant.fp8 import Fp8LinearMethod, reference_w8a8

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(40, 64, generator=g)).to(DEVICE)
    w = torch.randn(48, 64, generator=g) / 8
    wq, ws = quantize_per_row(w)
    wq, ws = wq.to(DEVICE), ws.view(-1).to(DEVICE)
    method = Fp8LinearMethod("triton", weight_only_max_tokens=8, scaled_mm=True)
    y = method.matmul(x, wq, ws, None)
    xq, xs = quantize_per_row(x)
    direct = kern.w8a8_linear(xq, xs, wq, ws, None, torch.float32)
    assert torch.equal(y, direct)
    want = reference_w8a8(x, wq, ws, None)
    mag = F.linear((xq.float() * xs).abs(), (wq.float() * ws[:, None]).abs())
    assert ((y - want).abs() <= (68 * 2**-24 + MMA_ROUNDING) * mag + 1e-30).all()


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


@pytest.fixture
def reduce_calls(kern, monkeypatch):
    """The ``split`` of every ``reduce_splits`` call the W8A8 module makes from here on
    (the second kernel runs at ``split`` > 1; the calls go through)."""
    seen = []
    real = kern.reduce_splits

    def reduce_splits(part, w_scale, bias, y, split):
        seen.append(split)
        real(part, w_scale, bias, y, split)

    monkeypatch.setattr(kern, "reduce_splits", reduce_splits)
    return seen


# (M, N, K, launch, split it takes): the table's 64 x 128 tiles over K = 1056 (M, N and K
# not multiples of the tile, the split's second chunk K-masked), small tiles split 3 over
# K = 200 (chunks of 96) and 4 over M = 70, and an unsplit launch
FIXUP_CASES = [(40, 136, 1056, None, 2), (20, 40, 200, "w8a8,16,16,32,3,4,1", 3),
               (70, 24, 256, "w8a8,32,32,32,4,4,1", 4), (33, 24, 160, "w8a8,32,16,32,0,4,2", 1)]


@pytest.mark.parametrize("m,n,k,config,split", FIXUP_CASES)
def test_w8a8_last_program_reduce_equals_the_reduce_kernel_bit_for_bit(
        kern, reduce_calls, m, n, k, config, split):
    """With tile counters, the last program of each tile sums the partials: y equals the
    two-kernel path exactly (float32 and bf16 outputs, with and without bias), the
    counters are all zero after every call, and a second call on them gives the same."""
    xq, xs, wq, ws = _operands(m, n, k, 11)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    counters = kern.make_tile_counters(m, n, k, DEVICE, config)
    cfg = kern.WoConfig.parse(config) if config else kern.w8a8_blocks(m, n, k)
    assert counters.dtype == torch.int32 and counters.numel() == (
        triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
    for out_dtype in (torch.float32, torch.bfloat16):
        for b in (None, bias.to(out_dtype)):
            two = kern.w8a8_linear(xq, xs, wq, ws, b, out_dtype, config)
            assert reduce_calls == [split]  # the two-kernel path, the reference
            for _ in range(2):
                one = kern.w8a8_linear(xq, xs, wq, ws, b, out_dtype, config,
                                       tile_counters=counters)
                assert torch.equal(one, two)
                assert not counters.any()
            assert reduce_calls == [split] + [1] * 2 * (split == 1)  # none at split > 1
            reduce_calls.clear()


def test_w8a8_refuses_tile_counters_it_cannot_use(kern):
    """Too few counters for the grid, or not int32: refused before the launch."""
    xq, xs, wq, ws = _operands(20, 72, 200, 13)
    cfg = "w8a8,16,16,32,3,4,1"
    counters = kern.make_tile_counters(20, 72, 200, DEVICE, cfg)
    for bad in (counters[:-1], counters.long()):
        with pytest.raises(AssertionError):
            kern.w8a8_linear(xq, xs, wq, ws, None, torch.float32, cfg, tile_counters=bad)


def test_fp8_layers_reduce_their_split_in_the_gemm_through_their_counters(
        kern, reduce_calls):
    """A column-parallel layer under ``Fp8LinearMethod`` (Triton, FP8 products) gets its
    own zeroed tile counters at load; at M = 40 (W8A8, split 2 over K = 1024) its forward,
    from activations or from an ``Fp8Activation``, runs the one-kernel path, equals the
    two-kernel one bit for bit and the reference W8A8 product to the kernel's bound, and
    leaves the counters at zero. A layer of an FP8 checkpoint gets counters of its own;
    the torch method none."""
    from tpserve.model.quant.fp8 import Fp8Activation, Fp8LinearMethod, reference_w8a8
    from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod
    from tpserve.parallel.comm import Communicator
    from tpserve.parallel.linear import ColumnParallelLinear
    from tpserve.parallel.state import TPGroup

    comm = Communicator(TPGroup(0, 1, DEVICE, None))
    g = torch.Generator().manual_seed(14)
    w = torch.randn(48, 1024, generator=g) / 32
    layers = {}
    for name, cls, backend in (("torch", Fp8LinearMethod, "torch"),
                               ("triton", Fp8LinearMethod, "triton"),
                               ("checkpoint", Fp8CheckpointMethod, "triton")):
        method = cls(backend, weight_only_max_tokens=8, scaled_mm=True)
        layer = ColumnParallelLinear(1024, 48, comm, dtype=torch.float32,
                                     quant_method=method)
        if cls is Fp8CheckpointMethod:  # the codes and scales the triton layer holds
            layer.weight.data.copy_(layers["triton"].weight)
            layer.weight_scale.data.copy_(layers["triton"].weight_scale)
        else:
            layer.weight.data.copy_(w)
        layer.process_weights_after_loading()
        layers[name] = layer.to(DEVICE)
    assert layers["torch"].w8a8_tile_counters is None
    layer = layers["triton"]
    counters = layer.w8a8_tile_counters
    assert counters.device.type == DEVICE.type and counters.dtype == torch.int32
    assert counters.numel() == 1 and not counters.any()  # one 64 x 128 tile up to M = 64
    x = torch.randn(40, 1024, generator=g).to(DEVICE)
    xq, xs = quantize_per_row(x)
    wq, ws = layer.weight, layer.weight_scale
    two = kern.w8a8_linear(xq, xs, wq, ws, None, torch.float32)
    assert reduce_calls == [2]
    checkpoint = layers["checkpoint"]
    assert checkpoint.w8a8_tile_counters.data_ptr() != counters.data_ptr()
    for y in (layer(x), layer(Fp8Activation(xq, xs, torch.float32)), checkpoint(x)):
        assert torch.equal(y, two)
        assert not counters.any() and not checkpoint.w8a8_tile_counters.any()
    assert reduce_calls == [2]  # the layers' calls ran no reduce kernel
    want = reference_w8a8(x, wq, ws, None)
    mag = F.linear((xq.float() * xs).abs(), (wq.float() * ws[:, None]).abs())
    assert ((two - want).abs() <= (1028 * 2**-24 + MMA_ROUNDING) * mag + 1e-30).all()


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.get_device_capability() < (8, 9),
                    reason="the compiled kernel's fp8 products and the GPU's memory ordering: "
                           "GPU only (compute capability >= 8.9)")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_w8a8_last_program_reduce_on_the_gpu_equals_the_reduce_kernel(kern, reduce_calls,
                                                                      n, k):
    """The llama3-8b shapes at M = 64 (split 2 for qkv, 4 for o and down on an H200;
    gate_up unsplit): 20 calls issued back to back on one counter buffer, each on other
    activations (a partial another program had not yet published, or a stale one, would
    show), then a CUDA graph of one call replayed on new activations: every output equals
    the two-kernel path's bit for bit and the counters end at zero."""
    g = torch.Generator(device=DEVICE).manual_seed(21)
    wq, ws = quantize_per_row(torch.randn(n, k, device=DEVICE, generator=g) / k ** 0.5)
    ws = ws.view(-1)
    xs_ = [quantize_per_row(torch.randn(64, k, device=DEVICE, generator=g)
                            * torch.logspace(-2, 1, 64, device=DEVICE)[:, None])
           for _ in range(20)]
    counters = kern.make_tile_counters(64, n, k, DEVICE)
    two = [kern.w8a8_linear(xq, xs, wq, ws, None, torch.bfloat16) for xq, xs in xs_]
    split = reduce_calls[0]
    one = [kern.w8a8_linear(xq, xs, wq, ws, None, torch.bfloat16, tile_counters=counters)
           for xq, xs in xs_]
    torch.cuda.synchronize()
    assert reduce_calls == [split] * 20 + [1] * 20 * (split == 1)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    assert not counters.any()
    static_q, static_s = (t.clone() for t in xs_[0])
    warm = torch.cuda.Stream(DEVICE)
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        kern.w8a8_linear(static_q, static_s, wq, ws, None, torch.bfloat16,
                         tile_counters=counters)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kern.w8a8_linear(static_q, static_s, wq, ws, None, torch.bfloat16,
                               tile_counters=counters)
    for i in (3, 7, 11, 19, 3):
        static_q.copy_(xs_[i][0])
        static_s.copy_(xs_[i][1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two[i])
        assert not counters.any()

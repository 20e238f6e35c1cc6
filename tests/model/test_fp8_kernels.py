"""The fp8 Triton kernels against their torch references (``model/quant/fp8.py``).

On a machine without CUDA they run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
before the kernel module is imported); on the GPU the same tests run compiled. The
interpreter's own float32 -> e4m3 cast is wrong (see ``kernels/triton_fp8_quant.py``), so the
quantizer's integer cast ``_e4m3_code`` is checked against torch's cast on every e4m3
value, midpoint and neighbour, on both back-ends (and the GPU's own cast too).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tests.model.test_triton_kernels import interpreted_modules  # noqa: E402
from tpserve.model.quant.fp8 import (  # noqa: E402
    FP8,
    Fp8LinearMethod,
    quantize_per_row,
    quantize_static,
    reference_quantized_product,
    reference_w8a8,
    reference_weight_only,
)
from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod  # noqa: E402

QUANT, NAME = "tpserve.model.kernels.triton_fp8_quant", "tpserve.model.kernels.triton_fp8"


@pytest.fixture(scope="module")
def kern():
    """The weight-only module, with the quantizer module beside it, interpreted off CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        pairs = ((QUANT, "_quant_per_token_kernel"), (NAME, "_wo_gemv_kernel"))
        yield interpreted_modules(mp, pairs, DEVICE.type == "cpu")[-1]


@pytest.fixture(scope="module")
def quant(kern):
    """The per-token quantizer module (loaded by ``kern``)."""
    return sys.modules[QUANT]


def _rows(m: int, k: int, dtype: torch.dtype, seed: int, spread: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # rows of very different magnitudes
        x = x * torch.logspace(-3, 2, m)[:, None]
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(5, 96), (3, 2500)])  # 2500: two blocks and a tail
def test_quantize_per_token_is_bit_exact(quant, dtype, m, k):
    x = _rows(m, k, dtype, 0)
    x[1] = 0  # a zero (padding) token: zero codes, the minimum scale, no NaN
    q, s = quant.quantize_per_token(x)
    want_q, want_s = quantize_per_row(x)
    assert q.dtype == FP8 and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q[1].float(), torch.zeros(k, device=DEVICE))


def test_quantize_per_token_scale_is_one_formula_on_every_device(quant):
    """The scale is ``amax * float32(1/448)``, a correctly rounded float32 product, in the
    kernel and the reference alike, whatever the device (a division by 448 would be one
    ulp apart between torch's CPU and CUDA for some amax). Here: amaxes where division
    and product differ."""
    amax = torch.tensor([0.7264, 0.3000, 1.1, 2.5e-3, 448.0, 5e-10])
    x = torch.zeros(len(amax), 16)
    x[:, 3] = amax
    x[:, 7] = -amax / 3
    _, s = quant.quantize_per_token(x.to(DEVICE))
    _, want = quantize_per_row(x.to(DEVICE))
    assert torch.equal(s, want)
    product = (amax.double() * quant.INV_FP8_MAX).float()  # exact, then rounded once
    quotient = amax / torch.full_like(amax, 448.0)
    assert (quotient != product).any()  # the two formulas really differ on these inputs
    assert torch.equal(s.view(-1).cpu(), product.clamp(min=quant.MIN_SCALE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_token_with_a_static_scale_is_bit_exact(quant, dtype):
    """A checkpoint's static ``input_scale``: every row takes it, and values beyond
    ``448 * scale`` clip (rows here span 1e-3 .. 1e2, so the largest rows clip and the
    smallest fall into e4m3's subnormals)."""
    x = _rows(6, 2500, dtype, 3)
    scale = torch.tensor([0.05], device=DEVICE)
    q, s = quant.quantize_per_token(x, static_scale=scale)
    want_q, want_s = quantize_static(x, scale)
    assert torch.equal(s, torch.full((6, 1), 0.05, device=DEVICE))
    assert torch.equal(want_s, s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    xf = x.float()
    clipped = xf.abs() > 448 * 0.05
    assert clipped.any() and (~clipped).any()
    assert torch.equal(q.float()[clipped], 448.0 * xf[clipped].sign())
    err = (q.float() * 0.05 - xf)[~clipped].abs()
    half_step = (xf[~clipped].abs() * 2**-4).clamp(min=2**-10 * 0.05)  # e4m3 rounding
    assert (err <= half_step * (1 + 1e-6)).all()


@pytest.mark.parametrize("m", [8, 40, 100])
def test_static_scale_method_matches_its_reference(kern, m):
    """An FP8 checkpoint's layer with a static input scale, on the Triton back-end, equals
    the torch reference of the path it takes: W8A8 with the static scale above the
    weight-only bound (the Triton W8A8 kernel at 40, ``_scaled_mm`` at 100, on a GPU with
    FP8 matrix products), else the weight-only product, which leaves the input as it is."""
    from types import SimpleNamespace

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = _rows(m, 64, dtype, 6, spread=False)
    wq, ws = _weight(32, 64, 5)
    scale = (x.float().abs().max() / 448 / 2).reshape(1)  # the largest inputs clip
    layer = SimpleNamespace(weight=wq, weight_scale=ws, input_scale=scale)
    fast = Fp8CheckpointMethod("triton", weight_only_max_tokens=8,
                               scaled_mm=DEVICE.type == "cuda"
                               and torch.cuda.get_device_capability() >= (8, 9),
                               static_activations=True)
    # a producer may quantize for it exactly where it takes W8A8 (with its scale)
    assert fast.takes_quantized_input(layer, m) == (m > 8 and fast.scaled_mm)
    assert fast.input_scale(layer) is scale
    y = fast.apply(layer, x, None).float()
    if m > 8 and fast.scaled_mm:
        xq, xs = quantize_static(x, scale)
        want = reference_quantized_product(xq, xs, wq, ws, None, torch.float32)
    else:
        want = reference_weight_only(x.float(), wq, ws, None)
    tol = (2**-7 if dtype == torch.bfloat16 else 1e-5) * want.abs().max()
    assert (y - want).abs().max() <= tol


@pytest.mark.parametrize("bit_cast", [True] + ([False] if DEVICE.type == "cuda" else []))
def test_fp8_cast_rounds_to_nearest_even_like_torch(quant, bit_cast):
    """Every e4m3 value, midpoint and the floats either side of each midpoint, through the
    kernel's cast (the row's amax is 448: scale exactly 1)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = codes[codes.isfinite()].unique()
    pos = finite[finite >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    vals = torch.cat([mids, mids.nextafter(torch.tensor(0.0)),
                      mids.nextafter(torch.tensor(1e9)), pos])
    vals = torch.cat([vals, -vals]).view(1, -1)
    vals[0, 0] = 448.0  # the row's amax is 448: the kernel's scale is exactly 1
    x = vals.to(DEVICE)
    q, s = quant.quantize_per_token(x, bit_cast)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), x.to(FP8).view(torch.uint8))


def _weight(n: int, k: int, seed: int, zero_rows=()) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[list(zero_rows)] = 0
    q, s = quantize_per_row(w)
    return q.to(DEVICE), s.view(-1).to(DEVICE)


def _check_weight_only(kern, x, wq, ws, bias, config=None):
    """The kernel against the float32 product of the dequantized weight: float32 outputs to
    a tight relative bound (the summation order differs), 16-bit outputs to one rounding
    of the output dtype; zero weight rows give exactly the bias (or zero)."""
    m, n = x.shape[0], wq.shape[0]
    y = kern.weight_only_linear(x, wq, ws, bias, config)
    want = F.linear(x.float(), wq.float() * ws[:, None], None if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == (m, n)
    # |error| <= eps(dtype) |y| + K * 2^-24 * sum|x w| (float32 sums in another order)
    mag = F.linear(x.float().abs(), wq.float().abs() * ws[:, None])
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[x.dtype]
    tol = eps * want.abs() + x.shape[1] * 2**-24 * mag + 1e-30
    assert ((y.float() - want).abs() <= tol).all(), (y.float() - want).abs().max()
    ref = reference_weight_only(x, wq, ws, bias).float()  # the method's own reference
    assert ((y.float() - ref).abs() <= 2 * tol).all()
    col = torch.zeros(m, device=DEVICE) if bias is None else bias[0].float().expand(m)
    assert torch.equal(y[:, 0].float(), col)


# the shipped table, then explicit launches: split and unsplit, tails of every block
CONFIGS = [None, "gemv,1,16,64,1,4", "gemvr,1,8,32,3,4", "gemve,1,16,32,0,2", "gemvre,1,8,64,2,4",
           "dot,16,16,32,1,4", "dot,16,32,64,2,4", "dot,32,16,32,0,4,2"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (2, 40, 100), (3, 72, 200), (4, 24, 600),
                                   (9, 40, 96)])
def test_weight_only_launches_match_the_reference(kern, config, m, n, k):
    """Every launch kind at M = 1..9, N tails (40, 72), K not a multiple of the block
    (100, 200, 600) or of the split, zero weight rows, with and without bias; float32."""
    x = _rows(m, k, torch.float32, 1, spread=False)
    wq, ws = _weight(n, k, 2, zero_rows=(0, n - 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for b in (None, bias):
        _check_weight_only(kern, x, wq, ws, b, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 40, 100), (8, 72, 160), (20, 72, 96),
                                   (33, 24, 64), (64, 40, 48), (70, 136, 64)])
def test_weight_only_linear_matches_the_reference(kern, dtype, m, n, k):
    """The default launch (``weight_only_blocks``) at M = 1..70 in each activation dtype;
    a zero activation row gives exactly the bias."""
    x = _rows(m, k, dtype, 1, spread=False)
    x[m // 2] = 0
    wq, ws = _weight(n, k, 2, zero_rows=(0, n - 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    for b in (None, bias):
        _check_weight_only(kern, x, wq, ws, b)
        y = kern.weight_only_linear(x, wq, ws, b)
        assert torch.equal(y[m // 2], torch.zeros_like(y[0]) if b is None else b)


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (1024, 4096), (4096, 1792)])
def test_weight_only_table_fills_the_gpu(kern, m, n, k):
    """The static launch table (no kernel run): at least two programs per H200 SM for
    llama3-8b shapes, also per tp-8 shard, and whole ``BLOCK_K`` steps per split chunk."""
    cfg = kern.weight_only_blocks(m, n, k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split or kern.auto_split(tiles, k, cfg.block_k, 132)
    assert cfg.kind in ("gemvre", "dot") and split >= 1
    assert tiles * split >= 2 * 132 or split == max(1, k // (4 * cfg.block_k))
    assert (cfg.kind == "dot") == (cfg.block_m >= 16)
    assert (cfg.kind == "gemvre") == (m <= 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,half,k", [(1, 40, 96), (2, 72, 200), (1, 6, 4100)])
def test_gate_up_gemv_with_silu_equals_gating_the_float32_product(kern, dtype, m, half, k):
    """The fused gate/up GEMV + SiLU at M = 1, 2 (N tails, K tails): ``silu(g) * u`` of the
    float32 products of the dequantized weight, to one rounding of the output dtype plus
    the float32 summation order; zero gate rows give exactly 0; with and without bias."""
    x = _rows(m, k, dtype, 6, spread=False)
    wq, ws = _weight(2 * half, k, 7, zero_rows=(0,))
    bias = torch.randn(2 * half, generator=torch.Generator().manual_seed(8)).to(dtype)
    for b in (None, bias.to(DEVICE)):
        y = kern.weight_only_silu_mul(x, wq, ws, b)
        assert y is not None and y.dtype == dtype and y.shape == (m, half)
        gu = F.linear(x.float(), wq.float() * ws[:, None], None if b is None else b.float())
        g, u = gu[:, :half], gu[:, half:]
        want = F.silu(g) * u
        mag = F.linear(x.float().abs(), wq.float().abs() * ws[:, None])
        err = k * 2**-24 * (mag[:, :half] * u.abs() + mag[:, half:] * g.abs()) * 2
        eps = {torch.float32: 2**-20, torch.bfloat16: 2**-7}[dtype]
        assert ((y.float() - want).abs() <= eps * want.abs() + err + 1e-30).all()
        if b is None:
            assert torch.equal(y[:, 0].float(), torch.zeros(m, device=DEVICE))


def test_gate_up_gemv_with_silu_declines_where_no_gemv_runs(kern):
    """M = 3 takes the tiled kernel, so the fused call returns None (the caller gates)."""
    wq, ws = _weight(16, 64, 9)
    assert kern.weight_only_silu_mul(_rows(3, 64, torch.float32, 1), wq, ws, None) is None


def test_merged_layer_gates_in_one_kernel_or_falls_back_identically(kern):
    """``MergedColumnParallelLinear.forward_silu_mul`` with the Triton fp8 method: at M = 1
    the fused kernel, at M = 5 (weight-only up to 32 tokens here) the matmul then the
    separate gate; both equal the torch reference's ``silu_and_mul(layer(x))`` (float32,
    summation order aside)."""
    from tpserve.model.quant.fp8 import Fp8LinearMethod
    from tpserve.parallel.comm import Communicator
    from tpserve.parallel.linear import MergedColumnParallelLinear
    from tpserve.parallel.state import TPGroup

    def silu_and_mul(t):
        h = t.shape[-1] // 2
        return F.silu(t[..., :h]) * t[..., h:]

    comm = Communicator(TPGroup(0, 1, DEVICE, None))
    w = torch.randn(2 * 24, 64, generator=torch.Generator().manual_seed(10)) / 8
    outs = {}
    for backend in ("torch", "triton"):
        layer = MergedColumnParallelLinear(64, [24, 24], comm, dtype=torch.float32,
                                           quant_method=Fp8LinearMethod(
                                               backend, weight_only_max_tokens=32))
        layer.weight.data.copy_(w)
        layer.process_weights_after_loading()
        layer.to(DEVICE)
        for m in (1, 5):
            x = _rows(m, 64, torch.float32, 11, spread=False)
            outs[backend, m] = layer.forward_silu_mul(x, silu_and_mul)
            if backend == "triton":
                fused = layer.quant_method.apply_silu_mul(layer, x, None)
                assert (fused is None) == (m > 2)
    for m in (1, 5):
        torch.testing.assert_close(outs["triton", m], outs["torch", m], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 32])
def test_by_default_only_one_token_steps_are_weight_only(m):
    """``--fp8-weight-only-max-tokens`` defaults to 1: a 1-token step multiplies the
    unquantized activations by the fp8 weights, a step of 2 or more tokens quantizes them
    per token (W8A8); the torch path, bit for bit its references."""
    x = _rows(m, 64, torch.float32, 4).cpu()
    wq, ws = (t.cpu() for t in _weight(32, 64, 5))
    y = Fp8LinearMethod("torch").matmul(x, wq, ws, None)
    want = (reference_weight_only if m == 1 else reference_w8a8)(x, wq, ws, None)
    other = (reference_w8a8 if m == 1 else reference_weight_only)(x, wq, ws, None)
    assert torch.equal(y, want) and not torch.equal(y, other)


@pytest.mark.parametrize("m", [1, 8, 40])
def test_fp8_method_chooses_by_static_m_and_matches_its_reference(kern, m):
    """The Triton method at M below and above its weight-only bound equals the torch
    reference of the same path (W8A8 falls back to the weight-only kernel where there are
    no FP8 matrix products, so there it is compared with the weight-only reference)."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = _rows(m, 64, dtype, 4, spread=False)
    wq, ws = _weight(32, 64, 5)
    fast = Fp8LinearMethod("triton", weight_only_max_tokens=8,
                           scaled_mm=DEVICE.type == "cuda"
                           and torch.cuda.get_device_capability() >= (8, 9))
    y = fast.matmul(x, wq, ws, None).float()
    uses_w8a8 = m > 8 and fast.scaled_mm
    want = (reference_w8a8 if uses_w8a8 else reference_weight_only)(x.float(), wq, ws, None)
    tol = (2**-7 if dtype == torch.bfloat16 else 1e-5) * want.abs().max()
    assert (y - want).abs().max() <= tol

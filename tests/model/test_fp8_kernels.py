"""The fp8 Triton kernels against their torch references (``model/quant/fp8.py``).

On a machine without CUDA they run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
before the kernel module is imported); on the GPU the same tests run compiled. The
interpreter's own float32 -> e4m3 cast is wrong (see ``kernels/triton_fp8.py``), so the
quantizer's integer cast ``_e4m3_code`` is checked against torch's cast on every e4m3
value, midpoint and neighbour, on both back-ends (and the GPU's own cast too).
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

from tpserve.model.quant.fp8 import (  # noqa: E402
    FP8,
    Fp8LinearMethod,
    quantize_per_row,
    reference_w8a8,
    reference_weight_only,
)
from tests.model.test_triton_kernels import _fix_interpreter_index  # noqa: E402

NAME = "tpserve.model.kernels.triton_fp8"


@pytest.fixture(scope="module")
def kern():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            _fix_interpreter_index(mp)
            if NAME in sys.modules:
                from triton.runtime.interpreter import InterpretedFunction
                mod = sys.modules[NAME]
                if not isinstance(mod._weight_only_kernel, InterpretedFunction):
                    importlib.reload(mod)
        yield importlib.import_module(NAME)


def _rows(m: int, k: int, dtype: torch.dtype, seed: int, spread: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if spread:  # rows of very different magnitudes
        x = x * torch.logspace(-3, 2, m)[:, None]
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(5, 96), (3, 2500)])  # 2500: two blocks and a tail
def test_quantize_per_token_is_bit_exact(kern, dtype, m, k):
    x = _rows(m, k, dtype, 0)
    x[1] = 0  # a zero (padding) token: zero codes, the minimum scale, no NaN
    q, s = kern.quantize_per_token(x)
    want_q, want_s = quantize_per_row(x)
    assert q.dtype == FP8 and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(q[1].float(), torch.zeros(k, device=DEVICE))


@pytest.mark.parametrize("bit_cast", [True] + ([False] if DEVICE.type == "cuda" else []))
def test_fp8_cast_rounds_to_nearest_even_like_torch(kern, bit_cast):
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
    q, s = kern.quantize_per_token(x, bit_cast)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8), x.to(FP8).view(torch.uint8))


def _weight(n: int, k: int, seed: int, zero_rows=()) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[list(zero_rows)] = 0
    q, s = quantize_per_row(w)
    return q.to(DEVICE), s.view(-1).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 40, 100), (20, 72, 96), (70, 136, 64)])
def test_weight_only_linear_matches_the_reference(kern, dtype, m, n, k):
    x = _rows(m, k, dtype, 1, spread=False)
    wq, ws = _weight(n, k, 2, zero_rows=(0, n - 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    for b in (None, bias):
        y = kern.weight_only_linear(x, wq, ws, b)
        want = F.linear(x.float(), wq.float() * ws[:, None], None if b is None else b.float())
        assert y.dtype == dtype and y.shape == (m, n)
        # float32 accumulation in another order, then one rounding to the output dtype
        # (bf16: one unit in the last place, since the interpreter truncates to bf16)
        eps = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-11}[dtype]
        tol = eps * want.abs() + 1e-5 * want.abs().max() + 1e-6
        assert ((y.float() - want).abs() <= tol).all()
        ref = reference_weight_only(x, wq, ws, b).float()  # the method's own reference
        assert ((y.float() - ref).abs() <= 2 * tol).all()
        # zero weight rows give exactly the bias (or zero)
        col = torch.zeros(m, device=DEVICE) if b is None else b[0].float().expand(m)
        assert torch.equal(y[:, 0].float(), col)


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

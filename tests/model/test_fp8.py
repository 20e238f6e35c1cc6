"""FP8 (e4m3) quantization helpers: the reference path that is the oracle of the GPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.model.quant.fp8 import FP8, FP8_MAX, dequantize, fp8_linear, quantize_per_row


def test_each_row_maps_its_largest_magnitude_to_the_largest_e4m3_value():
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 8)[:, None]
    q, scale = quantize_per_row(x)
    assert q.dtype == FP8 and scale.shape == (7, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=-1), torch.full((7,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: every element within half a unit in the last place (2^-4
    # relative) of its row's scale grid
    err = (dequantize(q, scale) - x).abs()
    assert (err <= x.abs() * 2**-4 + scale * 2**-9).all()


def test_a_zero_row_stays_zero():
    q, scale = quantize_per_row(torch.zeros(2, 16))
    assert torch.equal(dequantize(q, scale), torch.zeros(2, 16))


def test_reference_linear_is_the_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 5, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(48)
    wq, ws = quantize_per_row(w)
    y = fp8_linear(x, wq, ws, b, torch.float32)
    xq, xs = quantize_per_row(x.reshape(-1, 32))
    want = F.linear(dequantize(xq, xs), dequantize(wq, ws), b).reshape(3, 5, 48)
    assert y.shape == (3, 5, 48)
    assert torch.equal(y, want)
    # and close to the unquantized product (about 4 % of its largest magnitude)
    full = F.linear(x, w, b)
    assert (y - full).abs().max() <= 0.08 * full.abs().max()

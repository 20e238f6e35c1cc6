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


def test_quantized_model_holds_fp8_linear_weights_and_fewer_bytes():
    from tests.model.util import load
    from tpserve.model.quant.fp8 import Fp8LinearMethod

    base, _ = load(None)
    quant, _ = load(None, quant_method=Fp8LinearMethod())
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    proj = quant.model.layers[0].mlp.down_proj
    assert proj.weight.dtype == FP8 and proj.weight_scale.shape == (proj.weight.shape[0],)
    linear = sum(p.numel() for n, p in base.named_parameters() if "proj.weight" in n)
    scales = sum(p.numel() for n, p in quant.named_parameters() if "weight_scale" in n)
    # float32 linear weights (4 bytes) became 1 byte each plus a float32 scale per row
    assert nbytes(base) - nbytes(quant) == 3 * linear - 4 * scales


def test_config_errors_name_the_flag():
    import pytest

    from tpserve.cli import build_parser
    from tpserve.model.runner import RunnerConfig
    from tpserve.server.config import config_from_args

    with pytest.raises(ValueError, match="--quantization must be one of none, fp8"):
        RunnerConfig(quantization="int4")
    with pytest.raises(ValueError, match="--fp8-weight-only-max-tokens must be >= 0"):
        RunnerConfig(quantization="fp8", fp8_weight_only_max_tokens=-1)
    parser, _ = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int4"])
    cfg = config_from_args(parser.parse_args(["serve", "--quantization", "fp8",
                                              "--fp8-weight-only-max-tokens", "16"]))
    assert cfg.runner.quantization == "fp8" and cfg.runner.fp8_weight_only_max_tokens == 16
    assert config_from_args(parser.parse_args(["serve"])).runner.quantization == "none"

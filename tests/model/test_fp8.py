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


def test_weight_scales_are_the_least_error_candidates():
    """Each row's scale is, of ``amax / 448 * 2^(i/8)``, the one with the least squared
    error (recomputed here row by row), nothing saturates, and on Gaussian weights the
    search leaves less error than the amax scale alone."""
    from tpserve.model.quant.fp8 import (
        SEARCH_ROWS,
        WEIGHT_SCALE_CANDIDATES,
        quantize_per_row,
        searched_amax,
    )

    g = torch.Generator().manual_seed(3)
    w = torch.randn(SEARCH_ROWS + 37, 96, generator=g) * torch.rand(SEARCH_ROWS + 37, 1, generator=g)
    w[5] = 0.0
    amax = w.abs().amax(dim=-1, keepdim=True)
    q, scale = quantize_per_row(w, searched_amax(w, amax))
    err = ((dequantize(q, scale) - w) ** 2).sum(-1, dtype=torch.float64)
    plain = ((dequantize(*quantize_per_row(w)) - w) ** 2).sum(-1, dtype=torch.float64)
    for r in (0, 5, 17, SEARCH_ROWS - 1, SEARCH_ROWS, SEARCH_ROWS + 36):  # both chunks
        cands = []
        for i in range(WEIGHT_SCALE_CANDIDATES):
            f = torch.tensor(2.0 ** (i / WEIGHT_SCALE_CANDIDATES), dtype=torch.float32)
            qi, si = quantize_per_row(w[r:r + 1], amax[r:r + 1] * f)
            sq = (dequantize(qi, si) - w[r]) ** 2
            cands.append((sq.sum(dtype=torch.float64).item(), si.item()))
        best = min(range(len(cands)), key=lambda i: (cands[i][0], i))
        assert scale[r].item() == cands[best][1] and err[r].item() == cands[best][0], r
    assert err[5] == 0 and torch.equal(q[5].float(), torch.zeros(96))
    peak = q.float().abs().amax(dim=-1)[amax[:, 0] > 0]
    assert (peak > FP8_MAX / 2).all() and (peak <= FP8_MAX).all()
    assert (err <= plain).all() and err.sum() < 0.97 * plain.sum()


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
    from tpserve.model.runner_config import RunnerConfig
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
    assert cfg.runner.fp8_fast_accum is True  # the default
    slow = config_from_args(parser.parse_args(["serve", "-q", "fp8", "--no-fp8-fast-accum"]))
    assert slow.runner.fp8_fast_accum is False
    assert config_from_args(parser.parse_args(["serve"])).runner.quantization == "none"


def test_fast_accum_reaches_the_fp8_methods():
    """``--fp8-fast-accum`` is carried by the method ``linear_method`` builds, quantizing at
    load or serving an FP8 checkpoint as stored (``_scaled_mm``'s ``use_fast_accum``)."""
    import torch

    from tpserve.model.quant.checkpoint_format import CheckpointQuantization
    from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod
    from tpserve.model.quant.methods import linear_method

    cpu = torch.device("cpu")
    stored = CheckpointQuantization(method="fp8", quant_method="fp8")
    for ckpt in (None, stored):
        for fast in (False, True):
            m = linear_method("fp8", "triton", cpu, torch.bfloat16, 32, ckpt, fast_accum=fast)
            assert m.fast_accum is fast and isinstance(m, Fp8CheckpointMethod) == (ckpt is not None)
    assert linear_method("fp8", "torch", cpu, torch.float32, 32).fast_accum is True

"""Per-token fp8 quantization fused into its producers (``kernels/triton_fp8_fused.py``,
the torch composites in ``kernels/torch_ops.py``) and the model's use of them: RMSNorm before
qkv and gate/up, the SiLU gate before down, at step sizes where those layers run W8A8.

The fused kernels must give exactly the codes and scales of the unfused pair (the producer's
output, then ``quantize_per_token``) on the same back-end; the layers fed by them exactly
the outputs of the unfused path. Off CUDA the Triton kernels run in the interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from tests.model.test_triton_kernels import _fix_interpreter_index  # noqa: E402
from tpserve.model.kernels import torch_ops  # noqa: E402
from tpserve.model.quant.fp8 import (  # noqa: E402
    FP8,
    Fp8Activation,
    Fp8LinearMethod,
    quantize_per_row,
)
from tpserve.model.quant.fp8_block import Fp8BlockMethod  # noqa: E402
from tpserve.model.quant.fp8_checkpoint import Fp8CheckpointMethod  # noqa: E402

MODULES = ("tpserve.model.kernels.triton_fp8_quant", "tpserve.model.kernels.triton_fp8",
           "tpserve.model.kernels.triton_norm",
           "tpserve.model.kernels.triton_activation", "tpserve.model.kernels.triton_fp8_fused",
           "tpserve.model.kernels.triton_w8a8", "tpserve.model.kernels.triton_ops")


@pytest.fixture(scope="module")
def tri():
    """The Triton ops module (norms, activation and their fp8 variants), interpreted off
    CUDA, with the fp8 kernel modules it uses reloaded in order."""
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE.type == "cpu":
            _fix_interpreter_index(mp)
            for name in MODULES:
                if name in sys.modules:
                    importlib.reload(sys.modules[name])
        mods = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES}
        yield mods


def _same_codes(a: tuple, b: tuple) -> None:
    (qa, sa), (qb, sb) = a[:2], b[:2]
    assert qa.dtype == qb.dtype == FP8 and sa.dtype == sb.dtype == torch.float32
    assert torch.equal(sa, sb)
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    return x.to(dtype).to(DEVICE)


# a static input scale (an FP8 checkpoint's): rows of every magnitude take it, the largest
# clip at +-448 and the smallest fall into e4m3's subnormals; "group": a scale per 32
# columns (a block-wise checkpoint's activations; 32 does not divide 200 or 4100: a short
# last group)
SCALES = [None, 0.004, "group"]
SCALE_IDS = ["per-token", "static", "group"]
GROUP = 32


def _static(scale: float | str | None) -> torch.Tensor | None:
    return torch.tensor([scale], device=DEVICE) if isinstance(scale, float) else None


def _group(scale: float | str | None) -> int | None:
    return GROUP if scale == "group" else None


def _unfused(fp8, y: torch.Tensor, scale: float | str | None) -> tuple:
    """The Triton quantizer's codes and scales of ``y``, as each mode quantizes."""
    if scale == "group":
        return fp8.quantize_per_group(y, GROUP)
    return fp8.quantize_per_token(y, static_scale=_static(scale))


def _clipped_and_not(q: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Under a static scale (chosen so) some codes clip at +-448 and some do not."""
    if scale is not None:
        top = q.float().abs() == 448.0
        assert top.any() and (~top).any()


@pytest.mark.parametrize("scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,h", [(5, 96), (3, 200)])  # 200: a tail past the power of two
def test_fused_norms_quantize_exactly_what_the_norms_write(tri, dtype, m, h, scale):
    ops, fp8 = tri["triton_ops"], tri["triton_fp8_quant"]
    static = _static(scale)
    x, res = _rows(m, h, dtype, 1), _rows(m, h, dtype, 2)
    x[1] = 0
    res[1] = 0  # a zero (padding) row: zero codes (the minimum scale when per token)
    w = (torch.rand(h, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype).to(DEVICE)
    plain = ops.rms_norm(x, w, 1e-6)
    got = ops.rms_norm_fp8(x, w, 1e-6, static, _group(scale))
    _same_codes(got, _unfused(fp8, plain, scale))
    _clipped_and_not(got[0], static)
    assert got[2] == plain.dtype
    assert got[1].shape == (m, -(-h // GROUP) if scale == "group" else 1)
    assert torch.equal(got[0][1].float(), torch.zeros(h, device=DEVICE))
    normed, summed = ops.add_rms_norm(x, res, w, 1e-6)
    q, s, out_dtype, summed2 = ops.add_rms_norm_fp8(x, res, w, 1e-6, static_scale=static,
                                                    group=_group(scale))
    _same_codes((q, s), _unfused(fp8, normed, scale))
    assert out_dtype == normed.dtype and torch.equal(summed2, summed)


@pytest.mark.parametrize("scale", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,d", [(4, 64), (2, 4100)])  # 4100: three chunks and a tail
@pytest.mark.parametrize("row_block_max", [None, 1024], ids=["row-in-registers", "chunked"])
def test_fused_gate_quantizes_exactly_what_the_gate_writes(tri, dtype, m, d, row_block_max,
                                                           scale):
    ops, fp8 = tri["triton_ops"], tri["triton_fp8_quant"]
    static = _static(scale)
    x = _rows(m, 2 * d, dtype, 4)
    x[0, :d] = 0  # a zero gate row: silu(0) * up = 0
    x[-1, d - 1], x[-1, 2 * d - 1] = 30.0, 1e5  # the row's amax in its last column
    kw = {} if row_block_max is None else {"row_block_max": row_block_max}
    got = tri["triton_fp8_fused"].silu_and_mul_fp8(x, static, _group(scale), **kw)
    _same_codes(got, _unfused(fp8, ops.silu_and_mul(x), scale))
    _clipped_and_not(got[0], static)
    assert got[2] == dtype and got[0].shape == (m, d)
    assert torch.equal(got[0][0].float(), torch.zeros(d, device=DEVICE))
    # the amax is the tail's: its code is the largest, +448 (under the static scale too)
    assert got[0][-1, d - 1].float().item() == 448.0


@pytest.mark.parametrize("scale", SCALES, ids=SCALE_IDS)
def test_torch_composites_quantize_the_reference_ops(scale):
    """The torch back-end's fp8 variants are the reference ops then ``quantize_per_row``
    (with a static scale: ``quantize_static``; per group: ``quantize_per_group``)."""
    from tpserve.model.quant.fp8 import quantize_per_row, quantize_static
    from tpserve.model.quant.fp8_block import quantize_per_group

    static = None if not isinstance(scale, float) else torch.tensor([scale])
    group = _group(scale)

    def quantize(y):
        if group is not None:
            return quantize_per_group(y, group)
        return quantize_per_row(y) if static is None else quantize_static(y, static)

    x, res = _rows(6, 48, torch.float32, 5).cpu(), _rows(6, 48, torch.float32, 6).cpu()
    w = torch.rand(48, generator=torch.Generator().manual_seed(7)) + 0.5
    got = torch_ops.rms_norm_fp8(x, w, 1e-5, static, group)
    _same_codes(got, quantize(torch_ops.rms_norm(x, w, 1e-5)))
    _clipped_and_not(got[0], static)
    q, s, _, summed = torch_ops.add_rms_norm_fp8(x, res, w, 1e-5, static_scale=static,
                                                 group=group)
    normed, summed_ref = torch_ops.add_rms_norm(x, res, w, 1e-5)
    _same_codes((q, s), quantize(normed))
    assert torch.equal(summed, summed_ref)
    _same_codes(torch_ops.silu_and_mul_fp8(torch.cat([x, res], -1), static, group),
                quantize(torch_ops.silu_and_mul(torch.cat([x, res], -1))))


def _method(backend: str) -> Fp8LinearMethod:
    # Triton: W8A8 from 9 tokens (the interpreter has no _scaled_mm: the Triton W8A8
    # kernel takes every such step there); torch: the float32 reference
    return Fp8LinearMethod(backend, weight_only_max_tokens=8, scaled_mm=backend == "triton",
                           w8a8_triton_max_tokens=1 << 20)


def _static_method(backend: str) -> Fp8CheckpointMethod:
    """``_method`` for an FP8 checkpoint with static activation scales."""
    return Fp8CheckpointMethod(backend, weight_only_max_tokens=8,
                               scaled_mm=backend == "triton", w8a8_triton_max_tokens=1 << 20,
                               static_activations=True)


def _load_static(layer, g: torch.Generator, input_scales: dict) -> None:
    """Loads ``layer`` as from a static FP8 checkpoint: per-tensor e4m3 weights of random
    values, each part's ``input_scale`` from ``input_scales``, through the layer's loaders."""
    cols = layer.weight.shape[1]
    for part in layer.checkpoint_parts():
        q, s = quantize_per_row(torch.randn(layer.checkpoint_rows(part), cols, generator=g) / 8)
        layer.weight.weight_loader(layer.weight, q, part)
        layer.weight_scale.weight_loader(layer.weight_scale, s.view(-1), part)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor(input_scales[part]),
                                        part)


def _load_block(layer, g: torch.Generator) -> None:
    """Loads ``layer`` as from a block-wise ([8, 16]) FP8 checkpoint: random codes, random
    block scales, through the layer's loaders."""
    cols = layer.weight.shape[1]
    for part in layer.checkpoint_parts():
        rows = layer.checkpoint_rows(part)
        q, _ = quantize_per_row(torch.randn(rows, cols, generator=g))
        layer.weight.weight_loader(layer.weight, q, part)
        scale = torch.rand(-(-rows // 8), -(-cols // 16), generator=g) / 100 + 1e-3
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale, part)


def _mlp(backend: str, ops_name: str, mode: str | None = None):
    """A one-rank ``LlamaMLP`` on ``_method`` (weights quantized at load); with ``mode``
    "static" on ``_static_method`` (its gate/up input scales 0.002 and 0.004 (up's),
    down's 0.002, so the largest inputs of both clip); "block" on a block-wise ([8, 16])
    ``Fp8BlockMethod``, its activations quantized per 16 columns."""
    from tpserve.model.config import ModelConfig
    from tpserve.model.kernels.backend import select_ops
    from tpserve.model.llama import LlamaMLP
    from tpserve.parallel.comm import Communicator
    from tpserve.parallel.state import TPGroup

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                 "intermediate_size": 96, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_hidden_layers": 1,
                                 "vocab_size": 128})
    comm = Communicator(TPGroup(0, 1, DEVICE, None))
    method = {"static": _static_method(backend),
              "block": Fp8BlockMethod(backend, weight_only_max_tokens=8,
                                      scaled_mm=backend == "triton", block=(8, 16))
              }.get(mode, _method(backend))
    mlp = LlamaMLP(cfg, comm, select_ops(ops_name), torch.float32, "all_reduce", method)
    g = torch.Generator().manual_seed(8)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        if mode == "static":
            _load_static(layer, g, {0: 0.002, 1: 0.004, None: 0.002})
        elif mode == "block":
            _load_block(layer, g)
        else:
            layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g) / 8)
        layer.process_weights_after_loading()
    return mlp.to(DEVICE)


FUSED_MLPS = [(b, b, mode) for mode in (None, "static", "block") for b in ("torch", "triton")]
FUSED_MLP_IDS = [b + ("" if mode is None else "-" + mode)
                 for mode in (None, "static", "block") for b in ("torch", "triton")]


@pytest.mark.parametrize("backend,ops_name,mode", FUSED_MLPS, ids=FUSED_MLP_IDS)
def test_mlp_feeds_down_the_gate_it_quantized_and_equals_the_unfused_path(tri, backend,
                                                                          ops_name, mode):
    """At 12 tokens (W8A8) ``LlamaMLP`` gates and quantizes in one op and hands the
    ``Fp8Activation`` to down: the output equals down's own quantization of the gate
    exactly (per token, with down's static input scale, or per 16 columns for a
    block-wise down); at 4 tokens (weight-only) nothing is quantized by the producer."""
    from tpserve.parallel.linear import input_quantization

    mlp = _mlp(backend, ops_name, mode)
    scale, group = input_quantization(mlp.down_proj, 12)
    assert (scale is None) is (mode != "static")
    assert group == (16 if mode == "block" else None)
    if mode == "static":
        assert torch.equal(scale.cpu(), torch.tensor([0.002]))
    for m, fused in ((12, True), (4, False)):
        x = _rows(m, 64, torch.float32, 9)
        assert (input_quantization(mlp.down_proj, m) is not None) is fused
        want = mlp.down_proj(mlp.ops.silu_and_mul(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), want)


@pytest.mark.parametrize("backend,ops_name,mode", FUSED_MLPS, ids=FUSED_MLP_IDS)
def test_layers_take_a_norm_quantized_input_exactly(tri, backend, ops_name, mode):
    """A merged column-parallel layer fed the norm's ``Fp8Activation`` returns what it
    returns for the norm's plain output (which it quantizes itself): per token, with the
    layer's static input scale (the larger of gate's and up's, 0.004), or per 16 columns
    (block-wise: 4 scales a row)."""
    from tpserve.model.kernels.backend import select_ops
    from tpserve.model.layers.norm import RMSNorm
    from tpserve.parallel.linear import input_quantization

    mlp = _mlp(backend, ops_name, mode)
    how = input_quantization(mlp.gate_up_proj, 12)
    scale = how.static_scale
    if mode == "static":
        assert torch.equal(scale.cpu(), torch.tensor([0.004]))
    norm = RMSNorm(64, 1e-6, select_ops(ops_name), torch.float32).to(DEVICE)
    norm.weight.data.copy_(torch.rand(64, generator=torch.Generator().manual_seed(10)) + 0.5)
    x, res = _rows(12, 64, torch.float32, 11), _rows(12, 64, torch.float32, 12)
    h, summed = norm(x, res.clone())  # the norm writes the sum over its residual
    hq, summed_q = norm(x, res.clone(), quantize=how)
    assert isinstance(hq, Fp8Activation) and hq.shape == (12, 64)
    if mode == "static":
        assert torch.equal(hq.scale, scale.expand(12, 1))
        assert (hq.q.float().abs() == 448).any()  # some inputs clip at this scale
    assert hq.scale.shape == (12, 4 if mode == "block" else 1)
    assert torch.equal(summed_q, summed)
    assert torch.equal(mlp.gate_up_proj(hq), mlp.gate_up_proj(h))
    first = norm(x, quantize=how)
    assert torch.equal(mlp.gate_up_proj(first), mlp.gate_up_proj(norm(x)))

"""FP8 checkpoints served as stored (``quantization_config`` read by
``checkpoint_format.py``): each linear layer's e4m3 codes are copied from the file into its
fp8 weight, never widened, dequantized or re-quantized, and the checkpoint's scales become
the per-row ``weight_scale`` that ``Fp8LinearMethod.apply`` multiplies by (same kernels,
same weight-only / W8A8 choice, activations scaled per token at run time).

Invariants:
- ``weight_scale[i]`` (float32) is the scale of this rank's weight row ``i``: the scale the
  checkpoint stores for the tensor that row comes from (``q_proj``/``k_proj``/``v_proj`` of
  the fused qkv, ``gate_proj``/``up_proj`` of gate_up, or the layer's own), that tensor's
  one scale when stored per tensor (``[]``/``[1]``: expanded to every row of the part),
  the row's own when stored per channel (``[out]``/``[out, 1]``). Scales go through the
  layer's ``load_output_rows``, which maps rows exactly as the weight's loader does, so a
  row and its scale always come from the same checkpoint row, at every tp.
- Padding rows (zero codes) get ``MIN_SCALE``, as ``--quantization fp8`` gives a zero row:
  they multiply to exactly zero. A row-parallel layer holds every output row and so the
  whole scale; its columns on every rank share their row's scale (the checkpoint quantized
  the unsharded row), as the max-reduced amax of ``--quantization fp8`` does.
- Hence a checkpoint written by ``quantize_per_row`` from a weight loads into exactly the
  codes and scales ``--quantization fp8`` computes from that weight, at any tp.
- After loading, every row has a finite scale >= 0, else the load fails (a part's
  ``weight_scale`` missing from the checkpoint); a weight not stored as
  ``float8_e4m3fn`` fails the load instead of being cast.
- Static activation scales (``static_activations``): every part's ``input_scale`` (one
  finite float > 0; the load fails naming the layer when one is missing) is read, and the
  layer keeps their maximum (the parts of a fused layer share one input; vLLM takes the
  maximum too), ``input_scale [1]`` float32, the same on every rank. Each W8A8 product
  quantizes its input with it (``Fp8LinearMethod.matmul`` through ``input_scale``:
  ``quantize_static``, ``clamp(x / s, +-448)``, elementwise, so a row-parallel rank's
  columns quantize as those of the whole row and tp changes nothing but summation order);
  where the producer of the input (RMSNorm, the SiLU gate) quantizes it instead, it uses the
  same scale and formula (``input_scale``, handed over by ``parallel.linear.input_quantization``). Steps the weight-only product takes
  (``weight_only_max_tokens``) multiply the unquantized activations, as for every fp8
  model here (``--fp8-weight-only-max-tokens 0`` quantizes every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpserve.model.quant.fp8 import FP8, MIN_SCALE, Fp8LinearMethod
from tpserve.parallel.linear import empty_param
from tpserve.parallel.shard import TensorSource, as_source


class Fp8Source:
    """A checkpoint weight read as stored; anything but ``float8_e4m3fn`` is refused."""

    def __init__(self, source: TensorSource, what: str):
        self.source, self.what = source, what
        self.shape = source.shape

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        t = self.source.read(dim, start, length)
        if t.dtype != FP8:
            raise ValueError(f"{self.what} is stored as {t.dtype}, not float8_e4m3fn, but "
                             "config.json's quantization_config says the checkpoint is FP8")
        return t


def per_row_scale(value: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A checkpoint ``weight_scale`` as ``[rows]`` float32: one per tensor (``[]``/``[1]``)
    repeated on every row, or one per row (``[rows]``/``[rows, 1]``) as is."""
    v = value.float()
    if v.numel() == 1:
        return v.reshape(1).expand(rows).contiguous()
    if tuple(v.shape) in ((rows,), (rows, 1)):
        return v.reshape(rows)
    raise ValueError(f"{what}: weight_scale has shape {tuple(value.shape)}; expected one "
                     f"scale per tensor ([] or [1]) or per output row ([{rows}] or "
                     f"[{rows}, 1]); block-wise scales are read only where "
                     "quantization_config declares the block (weight_block_size)")


def create_fp8_weight(layer: nn.Module, rows: int, cols: int) -> None:
    """``layer.weight``: ``[rows, cols]`` e4m3 codes, loaded as stored (``Fp8Source``) by
    the layer's own weight loader."""
    layer.weight = empty_param((rows, cols), FP8)

    def load_weight(param: nn.Parameter, source, shard_id: object = None) -> None:
        what = f"linear weight (part {shard_id})" if shard_id is not None else "linear weight"
        layer.weight_loader(param, Fp8Source(as_source(source), what), shard_id)

    layer.weight.weight_loader = load_weight


def check_row_scales(scale: torch.Tensor, name: str) -> None:
    """ValueError unless every output row's scales (``scale`` row by row; NaN where no
    checkpoint scale was loaded) are finite and >= 0."""
    bad = ~(torch.isfinite(scale) & (scale >= 0)).reshape(scale.shape[0], -1).all(dim=1)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} of the {scale.shape[0]} output rows have no "
                         f"{name} in the checkpoint (or a negative or non-finite one)")


@dataclass(frozen=True)
class Fp8CheckpointMethod(Fp8LinearMethod):
    # an FP8 checkpoint's expert tensors (and their scales) are not read
    quantizes_experts = False

    """The ``quant_method`` of an FP8 checkpoint: loads codes and scales as stored
    (``create_weights``), checks them (``process_weights``); ``apply`` is
    ``Fp8LinearMethod``'s, its W8A8 products quantizing the input with the layer's
    ``input_scale`` under ``static_activations`` (``input_scale``)."""

    static_activations: bool = False

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        create_fp8_weight(layer, rows, cols)

        def load_scale(param: nn.Parameter, source, shard_id: object = None) -> None:
            what = f"part {shard_id}" if shard_id is not None else "linear layer"
            scale = per_row_scale(as_source(source).read(),
                                  layer.checkpoint_rows(shard_id), what)
            layer.load_output_rows(param, scale, shard_id, fill=MIN_SCALE)

        # NaN until loaded: a row no checkpoint scale reached is caught by process_weights
        layer.weight_scale = nn.Parameter(torch.full((rows,), float("nan")),
                                          requires_grad=False)
        layer.weight_scale.weight_loader = load_scale
        if not self.static_activations:
            return
        parts = layer.checkpoint_parts()

        def load_input_scale(param: nn.Parameter, source, shard_id: object = None) -> None:
            value = as_source(source).read()
            if value.numel() != 1:
                raise ValueError(f"input_scale has shape {tuple(value.shape)}; expected one "
                                 "scale per tensor ([] or [1])")
            param[parts.index(shard_id)] = value.reshape(()).float()

        # one per checkpoint part, NaN until loaded (process_weights checks)
        layer.input_scale = nn.Parameter(torch.full((len(parts),), float("nan")),
                                         requires_grad=False)
        layer.input_scale.weight_loader = load_input_scale

    def process_weights(self, layer: nn.Module) -> None:
        check_row_scales(layer.weight_scale, "weight_scale")
        if self.static_activations:
            inp = layer.input_scale
            bad = ~(torch.isfinite(inp) & (inp > 0))
            if bad.any():
                raise ValueError(f"{int(bad.sum())} of its {inp.numel()} checkpoint tensors "
                                 "have no input_scale (or a non-positive or non-finite one), "
                                 "which static activation scales need")
            layer.input_scale = nn.Parameter(inp.detach().amax().reshape(1),
                                             requires_grad=False)

    def input_scale(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.input_scale if self.static_activations else None

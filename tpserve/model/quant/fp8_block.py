"""Block-wise FP8 checkpoints served as stored: e4m3 weights with one scale per ``[bn, bk]``
block of the weight (vLLM's ``Fp8Config`` with ``weight_block_size``, transformers'
FineGrainedFP8, compressed-tensors' ``strategy: "block"``; the ``weight_scale_inv`` /
``weight_scale`` tensor is ``[ceil(out / bn), ceil(in / bk)]``), activations quantized at
run time per token and per group of ``bk`` input columns, as vLLM does.

The product: ``y[m, n] = sum_b xs[m, b] * ws[n, b] * sum_{k in group b} xq[m, k] wq[n, k]``
(W8A8, every group's fp8 products summed, then scaled by its two scales), or for steps of
at most ``weight_only_max_tokens`` tokens (and on GPUs without FP8 matrix products) the
unquantized activations times the block-dequantized weight, ``x @ (wq * ws)^T``. On the
GPU: weight-only through the tuned launches of ``triton_fp8.weight_only_linear`` (block
scales in their K loop); W8A8 through the Triton block GEMM up to
``w8a8_triton_max_tokens``, above it through cuBLAS's block scaling
(``torch.nn.functional.scaled_mm``, 1 x 128 activation and 128 x 128 weight blocks) where
``block_mm`` (it exists on this GPU and build: ``block_mm_supported``) and the layer's
blocks are those.

Invariants:
- ``layer.weight_scale`` is ``[rows / weight_scale_rows, k_groups]`` float32: entry ``[i,
  b]`` scales this rank's weight rows ``[i * weight_scale_rows, (i + 1) *
  weight_scale_rows)`` over its input columns ``[b * bk, (b + 1) * bk)``. Loaded per row
  (each checkpoint block's scale repeated on its ``bn`` rows, mapped by the layer's
  ``load_output_rows`` exactly as the weight's rows are, so padding rows and any head
  split are right at every tp), then stored per ``bn`` rows when every aligned run of
  ``bn`` rows shares its scales (``weight_scale_rows = bn``; else 1).
- A rank's input columns must fall in whole checkpoint blocks: each local group of ``bk``
  columns holds columns of one checkpoint block (or padding) only, else the load fails
  naming the layer (e.g. zero-head padding that shifts a rank's columns by half a
  block); the group takes that block's scale. So a row-parallel rank quantizes each
  activation group over the same columns as the unsharded layer, and tp changes nothing
  but summation order.
- Zero (padding) rows and columns have zero codes and a finite scale: exactly zero.
- Where a step is W8A8 the producer of the input (RMSNorm, the SiLU gate) may quantize it
  per token and ``bk`` columns in its own kernel (``takes_quantized_input``,
  ``input_group``) and hand over an ``Fp8Activation``: the codes and scales
  ``quantize_per_group`` gives, so the product is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.model.quant.fp8 import (
    FP8,
    MIN_SCALE,
    Fp8Activation,
    dequantize,
    quantize_per_row,
    tokens,
)
from tpserve.model.quant.fp8_checkpoint import (
    Fp8CheckpointMethod,
    check_row_scales,
    create_fp8_weight,
)
from tpserve.parallel.shard import as_source


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] e4m3, scale [M, ceil(K / group)] float32)``: each row's
    columns ``[b * group, (b + 1) * group)`` quantized as one row of ``quantize_per_row``
    (the last group may be shorter: zero padding does not change its amax)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = F.pad(x.float(), (0, groups * group - k)).reshape(m * groups, group)
    q, s = quantize_per_row(padded)
    return q.reshape(m, groups * group)[:, :k].contiguous(), s.reshape(m, groups)


def expand_scale(scale: torch.Tensor, scale_rows: int, shape: tuple[int, int], group: int
                 ) -> torch.Tensor:
    """Block scales ``[rows / scale_rows, groups]`` as one scale per element ``shape``."""
    n, k = shape
    return scale.repeat_interleave(scale_rows, 0)[:n].repeat_interleave(group, 1)[:, :k]


def dequantize_blocks(wq: torch.Tensor, scale: torch.Tensor, scale_rows: int, group: int
                      ) -> torch.Tensor:
    """The float32 weight ``wq * scale`` of block-scaled codes."""
    return dequantize(wq, expand_scale(scale, scale_rows, tuple(wq.shape), group))


def reference_block_w8a8(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                         scale_rows: int, group: int, bias: torch.Tensor | None
                         ) -> torch.Tensor:
    """``x [M, K]`` quantized per token and group, times the block-scaled weight, in
    float32 from the dequantized operands; ``[M, N]`` in ``x``'s dtype."""
    xq, xs = quantize_per_group(x, group)
    return reference_block_quantized(xq, xs, wq, scale, scale_rows, group, bias, x.dtype)


def reference_block_quantized(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor,
                              scale: torch.Tensor, scale_rows: int, group: int,
                              bias: torch.Tensor | None, out_dtype: torch.dtype
                              ) -> torch.Tensor:
    """Group-quantized ``xq [M, K]`` (scales ``xs [M, groups]``) times the block-scaled
    weight, in float32 from the dequantized operands; ``[M, N]`` in ``out_dtype``."""
    xd = dequantize(xq, expand_scale(xs, 1, tuple(xq.shape), group))
    y = F.linear(xd, dequantize_blocks(wq, scale, scale_rows, group),
                 None if bias is None else bias.float())
    return y.to(out_dtype)


def reference_block_weight_only(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                                scale_rows: int, group: int, bias: torch.Tensor | None
                                ) -> torch.Tensor:
    """The unquantized ``x [M, K]`` times the block-dequantized weight, in float32."""
    y = F.linear(x.float(), dequantize_blocks(wq, scale, scale_rows, group),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


def block_mm_supported(device: torch.device) -> bool:
    """Whether ``torch.nn.functional.scaled_mm`` multiplies 1 x 128 blocks of activations
    by 128 x 128 blocks of weights on ``device`` (cuBLAS on Hopper, CUDA >= 12.9): one
    128 x 512 x 128 product with a different scale per group is tried and checked."""
    if device.type != "cuda":
        return False
    try:
        ones = torch.ones(128, 512, device=device).to(FP8)
        xs = torch.arange(1, 5, device=device, dtype=torch.float32).expand(128, 4)
        ws = torch.full((1, 4), 2.0, device=device)
        y = cublas_block_product(ones, xs, ones, ws, None, torch.bfloat16)
    except (RuntimeError, ImportError, AttributeError, TypeError):
        return False
    return bool((y == 2 * 128 * (1 + 2 + 3 + 4)).all())


def cublas_block_product(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor,
                         ws: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """Group-quantized ``xq [M, K]`` (scales ``xs [M, K / 128]``) times ``wq [N, K]`` with
    128 x 128 block scales ``ws [N / 128, K / 128]``, through cuBLAS's block scaling; the
    activation scales are handed over outer-dim-major (a copy), as it reads them."""
    from torch.nn.functional import ScalingType, scaled_mm

    y = scaled_mm(xq, wq.t(), xs.t().contiguous().t(), ScalingType.BlockWise1x128, ws.t(),
                  ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return y if bias is None else y.add_(bias)


def takes_cublas_blocks(layer: nn.Module, group: int) -> bool:
    """Whether the layer's scales are what ``cublas_block_product`` reads: 128 x 128
    blocks, whole on every side, the groups a multiple of four (cuBLAS's padding)."""
    n, k = layer.weight.shape
    return (layer.weight_scale_rows == 128 and group == 128 and n % 128 == 0
            and k % 128 == 0 and (k // 128) % 4 == 0)


def local_groups(layer: nn.Module, cols: int, group: int) -> torch.Tensor:
    """For each group of ``group`` input columns this rank holds, the checkpoint block its
    columns come from (-1: padding only); ValueError where a group mixes two blocks. On
    the CPU, whatever the default device (layers are built under the serving device)."""
    cpu = torch.device("cpu")
    src = torch.arange(cols, device=cpu)  # column-parallel layers hold every input column
    in_map = getattr(layer, "in_map", None)
    if in_map is not None:
        src = torch.full((cols,), -1, device=cpu)
        u = in_map.unit
        for local, first, n in in_map.runs:
            src[local * u:(local + n) * u] = torch.arange(first * u, (first + n) * u,
                                                          device=cpu)
    groups = -(-cols // group)
    blocks = F.pad(src, (0, groups * group - cols), value=-1).reshape(groups, group)
    out = torch.full((groups,), -1, device=cpu)
    for b in range(groups):
        found = (blocks[b][blocks[b] >= 0] // group).unique()
        if len(found) > 1:
            raise ValueError(
                f"block-wise FP8 scales need this rank's input columns in whole "
                f"{group}-column blocks, but its columns {b * group}..{(b + 1) * group - 1} "
                f"come from blocks {found.tolist()} of the checkpoint (at this "
                f"--tensor-parallel-size the split or its zero padding is not aligned to "
                f"the blocks; vLLM refuses such splits too)")
        if len(found):
            out[b] = found[0]
    return out


@dataclass(frozen=True)
class Fp8BlockMethod(Fp8CheckpointMethod):
    """The ``quant_method`` of a block-wise FP8 checkpoint (``block``: ``(bn, bk)``;
    ``scale_name``: the checkpoint's name of the block scales)."""

    block: tuple[int, int] = (128, 128)
    scale_name: str = "weight_scale_inv"
    block_mm: bool = False

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        bn, bk = self.block
        create_fp8_weight(layer, rows, cols)
        groups = local_groups(layer, cols, bk)

        def load_scale(param: nn.Parameter, source, shard_id: object = None) -> None:
            value = as_source(source).read().float().cpu()
            n = layer.checkpoint_rows(shard_id)
            need = int(groups.max().item()) + 1
            # a column-parallel layer holds every column: exactly its groups' scales
            fits = value.dim() == 2 and (value.shape[1] >= need if hasattr(layer, "in_map")
                                         else value.shape[1] == len(groups))
            if not fits or value.shape[0] != -(-n // bn):
                raise ValueError(f"{self.scale_name} has shape {tuple(value.shape)}; expected "
                                 f"[{-(-n // bn)}, ceil(in_features / {bk})] for {n} rows "
                                 f"in blocks of {list(self.block)}")
            per_row = value.repeat_interleave(bn, 0)[:n]
            local = per_row[:, groups.clamp(min=0)]
            local[:, groups < 0] = MIN_SCALE  # padding-only groups: zero codes
            layer.load_output_rows(param, local, shard_id, fill=MIN_SCALE)

        # NaN until loaded: a row no checkpoint scale reached is caught by process_weights
        scale = nn.Parameter(torch.full((rows, len(groups)), float("nan")), requires_grad=False)
        scale.weight_loader = load_scale
        setattr(layer, self.scale_name, scale)

    def process_weights(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scale_name)
        delattr(layer, self.scale_name)
        check_row_scales(scale, self.scale_name)
        bn = self.block[0]
        rows = scale.shape[0]
        shared = rows % bn == 0 and bool(
            (scale.view(rows // bn, bn, -1) == scale.view(rows // bn, bn, -1)[:, :1]).all())
        layer.weight_scale_rows = bn if shared else 1
        compact = scale[::bn] if shared else scale
        layer.weight_scale = nn.Parameter(compact.detach().contiguous(), requires_grad=False)

    def takes_quantized_input(self, layer: nn.Module, num_tokens: int) -> bool:
        """Where the step is W8A8: the producer may quantize per ``input_group``."""
        return self.uses_w8a8(num_tokens, layer.weight)

    def input_group(self, layer: nn.Module) -> int:
        return self.block[1]

    def describe_products(self) -> str:
        cublas = (f"; cuBLAS's block scaling above {self.w8a8_triton_max_tokens}"
                  if self.block_mm else "")
        return (f"fp8 x fp8 products above {tokens(self.weight_only_max_tokens)} (the Triton "
                f"block-scaled GEMM{cublas}, activations per token and {self.block[1]} "
                "columns)")

    def apply_silu_mul(self, layer: nn.Module, x: torch.Tensor | Fp8Activation,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
        """The merged gate/up GEMV with its SiLU gate (``weight_only_silu_mul``, block
        scales) where the static M takes it; ``None`` elsewhere."""
        if isinstance(x, Fp8Activation) or self.backend != "triton":
            return None
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.uses_w8a8(x2.shape[0], layer.weight):
            return None
        from tpserve.model.kernels import triton_fp8

        y = triton_fp8.weight_only_silu_mul(x2, layer.weight, layer.weight_scale, bias,
                                            (layer.weight_scale_rows, self.block[1]))
        return None if y is None else y.reshape(*lead, y.shape[-1])

    def uses_w8a8(self, num_tokens: int, wq: torch.Tensor) -> bool:
        """W8A8 above ``weight_only_max_tokens``: on the torch back-end, or where the GPU
        has FP8 matrix products (``scaled_mm``)."""
        return num_tokens > self.weight_only_max_tokens and (self.backend == "torch"
                                                             or self.scaled_mm)

    def uses_cublas(self, layer: nn.Module, num_tokens: int, out_dtype: torch.dtype) -> bool:
        """W8A8 steps above ``w8a8_triton_max_tokens`` (bf16) take cuBLAS's block scaling
        where ``block_mm`` and the layer's blocks are what it reads."""
        return (self.block_mm and num_tokens > self.w8a8_triton_max_tokens
                and out_dtype == torch.bfloat16 and takes_cublas_blocks(layer, self.block[1]))

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activation,
              bias: torch.Tensor | None) -> torch.Tensor:
        args = (layer.weight, layer.weight_scale, layer.weight_scale_rows, self.block[1], bias)
        if isinstance(x, Fp8Activation):  # quantized per group by its producer (2-D)
            if self.backend == "torch":
                return reference_block_quantized(x.q, x.scale, *args, x.dtype)
            if self.uses_cublas(layer, x.q.shape[0], x.dtype):
                return cublas_block_product(x.q, x.scale, layer.weight, layer.weight_scale,
                                            bias, x.dtype)
            from tpserve.model.kernels import triton_fp8_block

            return triton_fp8_block.block_linear(x.q, *args, quantize_input=True,
                                                 x_scale=x.scale, out_dtype=x.dtype)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        w8a8 = self.uses_w8a8(x2.shape[0], layer.weight)
        if self.backend == "torch":
            y = (reference_block_w8a8 if w8a8 else reference_block_weight_only)(x2, *args)
        elif w8a8 and self.uses_cublas(layer, x2.shape[0], x2.dtype):
            from tpserve.model.kernels import triton_fp8_quant

            xq, xs = triton_fp8_quant.quantize_per_group(x2, self.block[1])
            y = cublas_block_product(xq, xs, layer.weight, layer.weight_scale, bias, x2.dtype)
        else:
            from tpserve.model.kernels import triton_fp8_block

            y = triton_fp8_block.block_linear(x2, *args, quantize_input=w8a8)
        return y.reshape(*lead, y.shape[-1])

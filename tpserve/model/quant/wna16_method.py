"""The ``quant_method`` of GPTQ and AWQ checkpoints (``--quantization gptq`` / ``awq``, from
the checkpoint's ``quantization_config``): integer weights served as stored, 4 or 8 bits
each, with float group scales and zero points, multiplied by activations in the model's
dtype (``wna16.py``: the served layout and the torch reference; the Triton kernel
``kernels/triton_wna16.py``).

Loading (``create_weights``): the checkpoint's packed tensors are read as the logical
``[out, in]`` integers (``int_checkpoint.CodesSource``) through the layer's own loaders,
so head padding, replicated KV heads and the row-parallel column split apply to them
exactly as to an unquantized weight:
- ``qweight`` uint8 ``[rows, cols]`` (one code a byte while loading), padding 0;
- ``qzeros`` uint8 ``[rows, G]`` and ``scales`` ``[rows, G]`` through
  ``load_output_rows``; padding rows get scale 0, so they multiply to exactly zero;
- ``g_idx`` (GPTQ) int32 ``[cols]`` through ``load_input_columns``: a row-parallel rank
  holds the groups of its own columns, every rank all ``G`` groups' scales (a group may
  span two ranks' columns; with act-order any rank may use any group). The parts of a
  fused layer (q/k/v, gate/up) share their input and must share their ``g_idx``.

``process_weights`` packs the codes along K (``wna16.pack_rows``), turns the zero points
into floats (plus GPTQ v1's offset of one), transposes scales and zeros to ``[G, N]`` and
checks every group index; the byte-per-code copy is freed. ``apply`` is the Triton kernel
with the Triton kernel back-end, the torch reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpserve.model.quant.int_checkpoint import AWQ_ORDER, CodesSource, TransposedSource
from tpserve.model.quant.wna16 import linear, pack_factor, pack_rows
from tpserve.parallel.linear import empty_param
from tpserve.parallel.shard import InMemorySource, as_source

UNSET = -1  # a g_idx entry no checkpoint tensor has reached yet


@dataclass(frozen=True)
class Wna16Method:
    """``fmt`` "gptq" or "awq"; ``bits``; ``group_size`` (-1: one group per row);
    ``zero_offset`` added to every stored zero point (1: GPTQ v1); ``backend`` "triton"
    or "torch"."""

    fmt: str
    bits: int
    group_size: int
    zero_offset: int = 0
    backend: str = "torch"
    quantizes_experts = False  # a mixture of experts' experts have no WNA16 product

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        pack = pack_factor(self.bits)
        if cols % pack:
            raise ValueError(f"this rank's {cols} input columns do not pack by {pack} "
                             f"({self.bits}-bit codes): choose another --tensor-parallel-size")
        full_cols = layer.in_features  # the checkpoint's (row parallel: every rank's)
        groups = 1 if self.group_size == -1 else -(-full_cols // self.group_size)
        layer.input_groups = groups
        packed_dim, order = (0, None) if self.fmt == "gptq" else (1, AWQ_ORDER)
        zeros_order = None if self.fmt == "gptq" else AWQ_ORDER

        layer.qweight = empty_param((rows, cols), torch.uint8)
        layer.qweight.weight_loader = (
            lambda p, src, shard_id=None: layer.weight_loader(
                p, CodesSource(as_source(src), self.bits, packed_dim, order), shard_id))
        layer.qzeros = empty_param((rows, groups), torch.uint8)
        layer.qzeros.weight_loader = (
            lambda p, src, shard_id=None: layer.load_output_rows(
                p, CodesSource(as_source(src), self.bits, 1, zeros_order), shard_id))
        layer.scales = empty_param((rows, groups), dtype)
        layer.scales.weight_loader = (
            lambda p, src, shard_id=None: layer.load_output_rows(
                p, TransposedSource(as_source(src)), shard_id, fill=0.0))
        if self.fmt != "gptq":
            return
        layer.g_idx = nn.Parameter(torch.full((cols,), UNSET, dtype=torch.int32),
                                   requires_grad=False)

        def load_g_idx(param: nn.Parameter, source, shard_id: object = None) -> None:
            loaded = torch.empty_like(param)
            layer.load_input_columns(loaded, as_source(source))
            if (param == UNSET).all():
                param.copy_(loaded)
            elif not torch.equal(param, loaded):
                raise ValueError(f"part {shard_id}'s g_idx differs from the other parts' "
                                 "(the parts of a fused layer share one input order)")

        layer.g_idx.weight_loader = load_g_idx

    def process_weights(self, layer: nn.Module) -> None:
        codes = layer.qweight
        del layer.qweight
        layer.qweight = nn.Parameter(pack_rows(codes.t(), self.bits), requires_grad=False)
        del codes
        dtype = layer.scales.dtype
        zeros = (layer.qzeros.float() + self.zero_offset).t().contiguous().to(dtype)
        del layer.qzeros
        layer.zeros = nn.Parameter(zeros, requires_grad=False)
        layer.scales = nn.Parameter(layer.scales.t().contiguous(), requires_grad=False)
        groups = layer.input_groups
        if self.fmt == "gptq":
            g_idx = layer.g_idx.data
        else:  # AWQ: consecutive groups, each rank's columns mapped as the weight's
            g_idx = torch.zeros(layer.qweight.shape[0] * pack_factor(self.bits),
                                dtype=torch.int32, device=layer.qweight.device)
            full = layer.in_features
            per = self.group_size if self.group_size > 0 else full
            layer.load_input_columns(g_idx, InMemorySource(
                torch.arange(full, dtype=torch.int32, device=g_idx.device) // per))
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"g_idx holds group indices outside [0, {groups})")
        layer.g_idx = nn.Parameter(g_idx.to(torch.int32), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.bits)
        if self.backend == "triton":
            from tpserve.model.kernels.triton_wna16 import wna16_matmul

            return wna16_matmul(x.contiguous(), *args, bias=bias)
        return linear(x, *args, bias=bias)

"""The ``quant_method`` of GPTQ, AWQ and compressed-tensors pack-quantized checkpoints
(``--quantization gptq`` / ``awq`` / ``compressed-tensors``, from the checkpoint's
``quantization_config``; tensor names and readers by ``int_checkpoint.FORMATS``): integer
weights served as stored, 4 or 8 bits
each, with float group scales and zero points, multiplied by activations in the model's
dtype (``wna16.py``: the served layout and the torch reference; the Triton kernel
``kernels/triton_wna16.py``).

Loading (``create_weights``): the checkpoint's packed tensors are read as the logical
``[out, in]`` integers (``int_checkpoint.CodesSource``) through the layer's own loaders,
so head padding, replicated KV heads and the row-parallel column split apply to them
exactly as to an unquantized weight:
- the codes (``qweight``; compressed-tensors' ``weight_packed``): each checkpoint tensor's
  rows of this rank are written by the layer's loader into a transient ``[rows, cols]``
  and packed at once into the served int32 ``[cols / pack, rows]`` (padding: code 0);
- the zero points (``qzeros``, uint8 ``[rows, G]``; none when symmetric) and ``scales``
  ``[rows, G]`` through ``load_output_rows``; padding rows get scale 0, so they multiply
  to exactly zero; compressed-tensors' ``weight_shape`` is checked against the layer;
- ``g_idx`` (GPTQ; compressed-tensors with act-order) int32 ``[cols]`` through
  ``load_input_columns`` (else ``k // group_size``, mapped the same way): a row-parallel rank
  holds the groups of its own columns, every rank all ``G`` groups' scales (a group may
  span two ranks' columns; with act-order any rank may use any group). The parts of a
  fused layer (q/k/v, gate/up) share their input and must share their ``g_idx``.

``process_weights`` turns the zero points into floats (plus GPTQ v1's offset of one),
transposes scales and zeros to ``[G, N]``, checks every group index and notes whether
the groups run in column order (``group_runs``: the kernels then read one scale row per
group, the torch reference scales whole groups); act-order columns are sorted by group
where that makes even runs (``wna16.sort_columns``: ``perm`` reorders the activations);
the codes are served as packed while loading. ``apply`` is the
Triton kernel with the Triton kernel back-end, the torch reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpserve.model.quant.int_checkpoint import FORMATS
from tpserve.model.quant.wna16 import (
    DEQUANT_MIN_M,
    linear,
    pack_factor,
    pack_rows,
    sort_columns,
)
from tpserve.parallel.linear import empty_param
from tpserve.parallel.shard import InMemorySource, as_source

UNSET = -1  # a g_idx entry no checkpoint tensor has reached yet


@dataclass(frozen=True)
class Wna16Method:
    """``fmt`` a key of ``int_checkpoint.FORMATS`` ("gptq", "awq", "compressed-tensors");
    ``bits``; ``group_size`` (-1: one group per row); ``zero_offset`` added to every
    stored zero point (1: GPTQ v1); ``symmetric``: no zero points stored, each is
    ``2**(bits - 1)`` (compressed-tensors); ``act_order``: groups in any column order
    (a compressed-tensors checkpoint then stores its ``g_idx``; GPTQ's always does);
    ``offset``: the zero points are float offsets added after the scale, ``W = q * s + z``
    (GGUF's ``Q4_1``, ``Q5_1``, K-quants and modules mixing types; served in the model's
    dtype); ``backend`` "triton" or "torch"."""

    fmt: str
    bits: int
    group_size: int
    zero_offset: int = 0
    backend: str = "torch"
    symmetric: bool = False
    act_order: bool = False
    offset: bool = False
    quantizes_experts = False  # a mixture of experts' experts have no WNA16 product

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        pack = pack_factor(self.bits)
        if cols % pack:
            raise ValueError(f"this rank's {cols} input columns do not pack by {pack} "
                             f"({self.bits}-bit codes): choose another --tensor-parallel-size")
        full_cols = layer.in_features  # the checkpoint's (row parallel: every rank's)
        groups = 1 if self.group_size == -1 else -(-full_cols // self.group_size)
        f = FORMATS[self.fmt]

        codes = nn.Parameter(torch.zeros((cols // pack, rows), dtype=torch.int32),
                             requires_grad=False)

        def load_codes(param: nn.Parameter, source, shard_id: object = None) -> None:
            # the layer's loader writes this part's rows (padding included) of a
            # transient [rows, cols] (-1: not this part's); they are packed into the
            # served columns at once, so the model never holds a byte per weight
            rows_of = torch.full((rows, cols), -1, dtype=torch.int16, device=param.device)
            layer.weight_loader(rows_of, f.read_codes(as_source(source), self.bits), shard_id)
            written = (rows_of >= 0).all(dim=1).nonzero().squeeze(1)
            with torch.no_grad():
                param[:, written] = pack_rows(rows_of[written].t(), self.bits)

        codes.weight_loader = load_codes
        setattr(layer, f.codes, codes)
        scales = empty_param((rows, groups), dtype)
        scales.weight_loader = (lambda p, src, shard_id=None: layer.load_output_rows(
            p, f.read_scales(as_source(src)), shard_id, fill=0.0))
        setattr(layer, f.scales, scales)
        if not self.symmetric:
            zeros = empty_param((rows, groups), dtype if self.offset else torch.uint8)
            zeros.weight_loader = (lambda p, src, shard_id=None: layer.load_output_rows(
                p, f.read_zeros(as_source(src), self.bits), shard_id))
            setattr(layer, f.zeros, zeros)
        if f.shape is not None:  # the unsharded [out, in] of each part: its columns checked
            shape = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)

            def check_shape(param: nn.Parameter, source, shard_id: object = None) -> None:
                value = [int(v) for v in as_source(source).read().reshape(-1)]
                want = [layer.checkpoint_rows(shard_id), full_cols]
                if value != want:
                    raise ValueError(f"{f.shape} is {value}; the model's layer is {want}")

            shape.weight_loader = check_shape
            setattr(layer, f.shape, shape)
        if f.g_idx is None or (self.fmt != "gptq" and not self.act_order):
            return
        g_idx = nn.Parameter(torch.full((cols,), UNSET, dtype=torch.int32),
                             requires_grad=False)

        def load_g_idx(param: nn.Parameter, source, shard_id: object = None) -> None:
            loaded = torch.empty_like(param)
            layer.load_input_columns(loaded, as_source(source))
            if (param == UNSET).all():
                param.copy_(loaded)
            elif not torch.equal(param, loaded):
                raise ValueError(f"part {shard_id}'s g_idx differs from the other parts' "
                                 "(the parts of a fused layer share one input order)")

        g_idx.weight_loader = load_g_idx
        setattr(layer, f.g_idx, g_idx)

    def process_weights(self, layer: nn.Module) -> None:
        f = FORMATS[self.fmt]
        codes = getattr(layer, f.codes)  # packed as loaded
        delattr(layer, f.codes)
        layer.qweight = codes
        scales = getattr(layer, f.scales)
        delattr(layer, f.scales)
        dtype = scales.dtype
        if self.symmetric:
            zeros = torch.full(scales.shape, 2**(self.bits - 1), device=scales.device)
        else:
            zeros = getattr(layer, f.zeros).float() + self.zero_offset
            delattr(layer, f.zeros)
        layer.zeros = nn.Parameter(zeros.t().contiguous().to(dtype), requires_grad=False)
        layer.scales = nn.Parameter(scales.t().contiguous(), requires_grad=False)
        if f.shape is not None:
            delattr(layer, f.shape)
        groups = layer.scales.shape[0]  # [G, N]
        if f.g_idx is not None and hasattr(layer, f.g_idx):
            g_idx = getattr(layer, f.g_idx).data
            delattr(layer, f.g_idx)
        else:  # consecutive groups, each rank's columns mapped as the weight's
            g_idx = torch.zeros(layer.qweight.shape[0] * pack_factor(self.bits),
                                dtype=torch.int32, device=layer.qweight.device)
            full = layer.in_features
            per = self.group_size if self.group_size > 0 else full
            layer.load_input_columns(g_idx, InMemorySource(
                torch.arange(full, dtype=torch.int32, device=g_idx.device) // per))
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"g_idx holds group indices outside [0, {groups})")
        qweight, g_idx, perm, layer.group_runs = sort_columns(
            layer.qweight.data, g_idx.to(torch.int32), self.bits, groups)
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.g_idx = nn.Parameter(g_idx, requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        args = (layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.bits)
        if self.backend == "triton":
            from tpserve.model.kernels.triton_wna16 import wna16_matmul

            return wna16_matmul(x.contiguous(), *args, bias=bias, perm=layer.perm,
                                runs=layer.group_runs, offset=self.offset)
        return linear(x, *args, bias=bias, runs=layer.group_runs, perm=layer.perm,
                      offset=self.offset)


def graph_scratch_bytes(model: nn.Module, max_tokens: int) -> int:
    """What the integer layers add to a captured step of up to ``max_tokens`` rows: from
    ``DEQUANT_MIN_M`` rows each product dequantizes its weight into a transient ``[K, N]``
    scratch, one layer at a time, so the graphs' pool needs the largest one (0 without
    integer layers or below that size)."""
    if max_tokens < DEQUANT_MIN_M:
        return 0
    return max((layer.g_idx.numel() * layer.qweight.shape[1] * layer.scales.element_size()
                for layer in model.modules()
                if isinstance(getattr(layer, "quant_method", None), Wna16Method)), default=0)

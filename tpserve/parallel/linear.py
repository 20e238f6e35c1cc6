"""Tensor-parallel linear layers. Each parameter carries a ``weight_loader`` that narrows the
checkpoint tensor to this rank's shard.

Weights follow torch's ``[out_features, in_features]`` layout:
- column parallel splits ``out_features`` (dim 0); ``gather_output`` all-gathers the shards;
- row parallel splits ``in_features`` (dim 1) and all-reduces the partial sums; the bias is
  added once, after the reduction.

Where a size does not divide by tp (attention heads, the MLP width) the shards are padded
with zero rows/columns (``ShardMap``, ``HeadLayout``) so the function is unchanged.

How a layer stores and multiplies its weight is its ``quant_method`` (duck-typed, so
``parallel/`` never imports a quantization scheme), an object with three methods:

- ``create_weights(layer, rows, cols, dtype)``: called once by the layer's constructor;
  registers ``layer.weight`` (``[rows, cols]``: this rank's shard, padding included) in the
  dtype it is stored in, and any parameter it loads beside it (e.g. a checkpoint's
  ``weight_scale``, one float per output row, loaded through ``layer.load_output_rows``;
  a GPTQ ``g_idx``, one int per input column, through ``layer.load_input_columns``), each
  with its ``weight_loader`` (the weight's: ``layer.weight_loader``, or a wrapper). A
  method may store the weight under other names (GPTQ's ``qweight``); ``layer.in_features``
  is the checkpoint's input size (a row-parallel rank holds ``in_per_rank`` of it).
- ``process_weights(layer)``: called once on every rank, in module order, after all of the
  layer's shards are loaded. It may replace ``layer.weight`` (e.g. by an fp8 tensor) and
  register more parameters (e.g. ``weight_scale``); it may run collectives on
  ``layer.comm`` (every rank processes the same layers in the same order), and it must map
  zero (padding) rows and columns to weights that still multiply to exactly zero.
- ``apply(layer, x, bias)``: ``x [T, in_per_rank] -> [T, out_per_rank]``, this rank's
  ``x W^T (+ bias)``; no host synchronisation (it runs inside CUDA graphs) and only static
  shapes may steer it.
- optionally ``takes_quantized_input(layer, num_tokens)``: True where ``apply`` at that
  static token count would quantize ``x`` itself; the model may then pass ``apply`` the
  input already quantized by the kernel that produced it, in the method's own format
  (the layers pass ``x`` through untouched).
- optionally ``input_scale(layer)``: the static scale that quantization uses (a
  checkpoint's ``input_scale``), None where it is per token; and ``input_group(layer)``:
  the columns of one activation scale where it is per group (block-wise checkpoints),
  None where per token. ``input_quantization`` below asks all three.

``UNQUANTIZED`` (``F.linear`` on the loaded weight) is the default.

``lora`` (None unless LoRA adapters are served: ``parallel/lora.py``; only over
``UNQUANTIZED``) computes this rank's output with the adapters' deltas, before any gather
or reduction, while a step has tokens under adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.parallel.comm import Communicator
from tpserve.parallel.heads import HeadLayout
from tpserve.parallel.shard import (
    NarrowSource,
    ShardMap,
    TensorSource,
    as_source,
    copy_into,
    split_evenly,
)


class UnquantizedLinear:
    """The default ``quant_method``: the weight stays as loaded; ``F.linear``."""

    def create_weights(self, layer: nn.Module, rows: int, cols: int,
                       dtype: torch.dtype | None) -> None:
        layer.weight = empty_param((rows, cols), dtype)
        layer.weight.weight_loader = layer.weight_loader

    def process_weights(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinear()  # stateless


class InputQuantization(NamedTuple):
    """How the producer of a layer's input quantizes it for the layer (the arguments of
    the ops' ``*_fp8`` kernels, in order): ``static_scale`` the one scale of every row (a
    checkpoint's ``input_scale``, ``[1]`` float32), None: a scale per token (or group);
    ``group`` the columns of one scale (block-wise checkpoints), None: the whole row."""

    static_scale: torch.Tensor | None
    group: int | None


def input_quantization(layer: nn.Module, num_tokens: int) -> InputQuantization | None:
    """None where ``layer``'s quant method does not want its input quantized by the input's
    producer at this static token count (its optional ``takes_quantized_input``), or where
    the layer carries LoRA adapters (their products take the unquantized input; the
    method then quantizes it itself); else how (its optional ``input_scale`` and
    ``input_group``)."""
    if getattr(layer, "lora", None) is not None:
        return None
    method = layer.quant_method
    takes = getattr(method, "takes_quantized_input", None)
    if takes is None or not takes(layer, num_tokens):
        return None
    scale = getattr(method, "input_scale", None)
    group = getattr(method, "input_group", None)
    return InputQuantization(None if scale is None else scale(layer),
                             None if group is None else group(layer))


def empty_param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    """An uninitialised, frozen parameter (on the current default device)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over ranks.

    Rank r holds rows ``[r*out/tp, (r+1)*out/tp)``. With ``gather_output`` the shards are
    all-gathered so every rank returns the full output; otherwise each returns its shard.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 bias: bool = False, gather_output: bool = False,
                 dtype: torch.dtype | None = None, quant_method=None):
        super().__init__()
        self._init_shard(in_features,
                         split_evenly(out_features, comm.world_size, "output features"),
                         comm, bias, gather_output, dtype, quant_method)

    def _init_shard(self, in_features: int, out_per_rank: int, comm: Communicator,
                    bias: bool, gather_output: bool, dtype: torch.dtype | None,
                    quant_method) -> None:
        """This rank's ``[out_per_rank, in_features]`` weight (and bias), each loaded by
        ``weight_loader``."""
        self.comm = comm
        self.quant_method = quant_method or UNQUANTIZED
        self.gather_output = gather_output
        self.out_per_rank = out_per_rank
        self.in_features = in_features  # every rank's: the input is not split
        self.quant_method.create_weights(self, out_per_rank, in_features, dtype)
        self.lora = None
        self.bias = empty_param((out_per_rank,), dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None, fill: float = 0.0) -> None:
        """Loads this rank's rows (dim 0) of the weight, or of any tensor indexed by output
        row (bias, per-row scale); ``fill``: the value of padding rows (none here: an even
        split)."""
        src = as_source(source)
        start = self.comm.rank * self.out_per_rank
        copy_into(param, src.read(0, start, self.out_per_rank), "column-parallel weight")

    def load_output_rows(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                         shard_id: object = None, fill: float = 0.0) -> None:
        """Loads a checkpoint tensor indexed by output row (its dim 0; ``checkpoint_rows
        (shard_id)`` long) into ``param``, one entry per row of this rank's weight, exactly
        as the weight's rows are loaded; padding rows get ``fill``."""
        self.weight_loader(param, source, shard_id, fill=fill)

    def load_input_columns(self, param: torch.Tensor, source: TensorSource | torch.Tensor,
                           fill: float = 0.0) -> None:
        """Loads a checkpoint tensor indexed by input column (its dim 0, ``in_features``
        long; e.g. a GPTQ ``g_idx``) into ``param``, one entry per column of this rank's
        weight: all of it (the input is not split)."""
        copy_into(param, as_source(source).read(), "column-parallel input columns")

    def checkpoint_rows(self, shard_id: object = None) -> int:
        """Rows of the checkpoint tensor that ``shard_id`` names (the unsharded part)."""
        return self.out_per_rank * self.comm.world_size

    def checkpoint_parts(self) -> tuple[object, ...]:
        """The ``shard_id`` of every checkpoint tensor this layer is made of, in order."""
        return (None,)

    def load_stacked(self, param: nn.Parameter, source: TensorSource | torch.Tensor) -> None:
        """Loads into ``param`` (the weight, or the bias) a checkpoint tensor that stores
        every part of this layer stacked along dim 0 in ``checkpoint_parts`` order (Phi-3's
        fused ``qkv_proj``: the q, k, v rows; ``gate_up_proj``: gate, then up). Each part
        goes, as a ``NarrowSource`` of its rows, through ``param.weight_loader`` with its
        shard id: exactly as if the checkpoint stored the parts apart (head padding,
        replicated KV heads and a quant method's loader included), each rank reading only
        its own rows."""
        src = as_source(source)
        parts = self.checkpoint_parts()
        rows = [self.checkpoint_rows(p) for p in parts]
        if not src.shape or src.shape[0] != sum(rows):
            raise ValueError(f"a fused tensor of shape {tuple(src.shape)}; expected "
                             f"{' + '.join(map(str, rows))} = {sum(rows)} rows (parts "
                             f"{', '.join(map(str, parts))})")
        offset = 0
        for part, n in zip(parts, rows, strict=True):
            param.weight_loader(param, NarrowSource(src, 0, offset, n), part)
            offset += n

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.batch.active:
            y = self.lora(x, self.bias)
        else:
            y = self.quant_method.apply(self, x, self.bias)
        return self.comm.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up).

    Each rank's weight is the concatenation of its shard of every part, in part order;
    ``shard_id`` (the part index) tells the loader where a checkpoint tensor goes. A part
    that tp does not divide is zero-padded to ``ceil(size / tp)`` rows per rank (padding
    rows at the end of the part; only the last ranks hold them).
    """

    def __init__(self, in_features: int, out_sizes: list[int], comm: Communicator,
                 bias: bool = False, dtype: torch.dtype | None = None, quant_method=None):
        self.out_sizes = list(out_sizes)
        self.parts = [ShardMap.contiguous(s, comm.world_size, comm.rank) for s in out_sizes]
        nn.Module.__init__(self)
        self._init_shard(in_features, sum(p.numel for p in self.parts), comm, bias, False,
                         dtype, quant_method)

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None, fill: float = 0.0) -> None:
        idx = int(shard_id)
        offset = sum(p.numel for p in self.parts[:idx])
        part = self.parts[idx]
        part.load(param.narrow(0, offset, part.numel), as_source(source), 0,
                  f"merged part {idx}", fill)

    def forward_silu_mul(self, x: torch.Tensor,
                         silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``silu_and_mul`` of this (gate, up) layer's output: in one kernel where the
        ``quant_method`` has one for this input (``apply_silu_mul`` returning a tensor),
        else ``silu_and_mul(self(x))``. Each rank gates its own shard (gate rows, then up
        rows), so the output stays sharded. A layer with LoRA adapters never takes the
        fused kernel (the adapters add to the product before the gate)."""
        assert not self.gather_output, "the gate applies to this rank's shard"
        fused = (getattr(self.quant_method, "apply_silu_mul", None) if self.lora is None
                 else None)
        y = fused(self, x, self.bias) if fused is not None else None
        return silu_and_mul(self(x)) if y is None else y

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return self.out_sizes[int(shard_id)]

    def checkpoint_parts(self) -> tuple[object, ...]:
        return tuple(range(len(self.out_sizes)))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split by attention heads as ``HeadLayout`` says.

    Rank r holds query heads ``[r*Hq'/tp, (r+1)*Hq'/tp)`` of the padded layout and the
    KV heads they use: split when ``Hkv' >= tp``, else one replicated KV head per rank.
    Padded heads' rows (and bias) are zero.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 comm: Communicator, bias: bool = False, dtype: torch.dtype | None = None,
                 quant_method=None):
        self.layout = HeadLayout.plan(num_heads, num_kv_heads, comm.world_size)
        self.head_dim = head_dim
        self.num_heads = self.layout.heads_per_rank
        self.num_kv_heads = self.layout.kv_heads_per_rank
        self.kv_head_start = self.layout.kv_head_start(comm.rank)
        q_map = self.layout.q_map(comm.rank, head_dim)
        kv_map = self.layout.kv_map(comm.rank, head_dim)
        q, kv = q_map.numel, kv_map.numel
        self.maps = {"q": (0, q_map), "k": (q, kv_map), "v": (q + kv, kv_map)}
        nn.Module.__init__(self)  # sizes are per head, not an even split of the output
        self._init_shard(hidden, q + 2 * kv, comm, bias, False, dtype, quant_method)

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None, fill: float = 0.0) -> None:
        offset, shard = self.maps[str(shard_id)]
        shard.load(param.narrow(0, offset, shard.numel), as_source(source), 0,
                   f"{shard_id}_proj shard", fill)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        heads = self.layout.num_heads if shard_id == "q" else self.layout.num_kv_heads
        return heads * self.head_dim

    def checkpoint_parts(self) -> tuple[object, ...]:
        return tuple(self.maps)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q+2kv] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]`` (this rank's heads)."""
        q_size, kv_size = self.maps["q"][1].numel, self.maps["k"][1].numel
        q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
        d = self.head_dim
        return (q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d),
                v.reshape(-1, self.num_kv_heads, d))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over ranks; the input is the matching
    shard of ``x`` (as produced by a column-parallel layer). Partial sums are all-reduced
    (``reduce="all_reduce"``) or reduce-scattered over tokens (``"reduce_scatter"``: rank
    r returns rows ``[r*T/tp, (r+1)*T/tp)``; T must divide by tp), then the (unsharded)
    bias is added once. ``reduce="none"``: this rank's partial sums, no bias, for a caller
    that adds other partial sums before reducing them once (a mixture of experts' shared
    expert).

    ``in_map`` says which checkpoint columns this rank holds (default: an even split); its
    padding columns are zero, so padded inputs (zero heads, zero MLP columns) add nothing.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 bias: bool = False, dtype: torch.dtype | None = None,
                 in_map: ShardMap | None = None, reduce: str = "all_reduce",
                 quant_method=None):
        super().__init__()
        if reduce not in ("all_reduce", "reduce_scatter", "none"):
            raise ValueError(f"unknown reduce {reduce!r}")
        if reduce == "none" and bias:
            raise ValueError("a row-parallel layer returning partial sums has no bias")
        self.comm = comm
        self.quant_method = quant_method or UNQUANTIZED
        self.reduce = reduce
        self.in_features = in_features  # the checkpoint's, unsharded
        self.out_features = out_features
        if in_map is None:
            per = split_evenly(in_features, comm.world_size, "input features")
            in_map = ShardMap(per, ((0, comm.rank * per, per),))
        self.in_map = in_map
        self.in_per_rank = in_map.numel
        self.quant_method.create_weights(self, out_features, self.in_per_rank, dtype)
        self.lora = None
        self.bias = empty_param((out_features,), dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                      shard_id: object = None) -> None:
        self.in_map.load(param, as_source(source), 1, "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                    shard_id: object = None) -> None:
        copy_into(param, as_source(source).read(), "row-parallel bias")

    def load_output_rows(self, param: nn.Parameter, source: TensorSource | torch.Tensor,
                         shard_id: object = None, fill: float = 0.0) -> None:
        """Loads a checkpoint tensor indexed by output row (bias, per-row scale): every rank
        holds every output row, so all of it (no padding rows)."""
        copy_into(param, as_source(source).read(), "row-parallel output rows")

    def load_input_columns(self, param: torch.Tensor, source: TensorSource | torch.Tensor,
                           fill: float = 0.0) -> None:
        """Loads a checkpoint tensor indexed by input column (its dim 0, ``in_features``
        long) into ``param``, one entry per column of this rank's weight, exactly as the
        weight's columns are loaded (``in_map``); padding columns get ``fill``."""
        self.in_map.load(param, as_source(source), 0, "row-parallel input columns", fill)

    def checkpoint_rows(self, shard_id: object = None) -> int:
        return self.out_features

    def checkpoint_parts(self) -> tuple[object, ...]:
        return (None,)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.batch.active:
            y = self.lora(x, None)
        else:
            y = self.quant_method.apply(self, x, None)
        if self.reduce == "all_reduce":
            y = self.comm.all_reduce(y)
        elif self.reduce == "reduce_scatter":
            y = self.comm.reduce_scatter(y)
        return y + self.bias if self.bias is not None else y

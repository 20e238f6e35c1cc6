"""GPTQ and AWQ checkpoints (``quant_method`` "gptq" / "awq"): their ``quantization_config``
checked into a ``CheckpointQuantization``, and their packed tensors read as the logical
``[out, in]`` integers the layers' own loaders shard (``CodesSource``, ``TransposedSource``).

The formats, as AutoGPTQ / GPTQModel and AutoAWQ write them (``bits`` b, ``pack = 32 // b``
codes per int32, a layer of ``in`` input and ``out`` output features, ``G`` groups of
``group_size`` input columns, one group of all of them for ``group_size`` -1):
- GPTQ: ``qweight`` int32 ``[in / pack, out]``, packed along the input (code of input row
  ``r * pack + j`` in bits ``[j b, (j + 1) b)`` of row ``r``); ``qzeros`` int32 ``[G, out /
  pack]``, packed along the output in the same order; ``scales`` ``[G, out]``; ``g_idx``
  int32 ``[in]``, the group of each input row (act-order, ``desc_act``: any order).
  ``checkpoint_format`` "gptq" (the default, v1) stores each zero point minus one; "gptq_v2"
  stores it as is. ``W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]``.
- AWQ (``version`` "gemm"): ``qweight`` int32 ``[in, out / pack]`` and ``qzeros`` int32
  ``[G, out / pack]``, both packed along the output with AutoAWQ's interleave (bits ``[j b,
  (j + 1) b)`` hold output column ``AWQ_ORDER[j]`` of the pack); ``scales`` ``[G, out]``;
  no ``g_idx`` (group ``i // group_size``). ``W[o, i] = (q[i, o] - z[i // gs, o]) * s[i //
  gs, o]``.

- compressed-tensors ``pack-quantized`` (llm-compressor's W4A16 / W8A16): ``weight_packed``
  int32 ``[out, in / pack]``, packed along the input in GPTQ's order, each code stored
  unsigned (the signed value plus ``2**(bits - 1)``); ``weight_scale`` ``[out, G]``;
  asymmetric: ``weight_zero_point`` int32 ``[out / pack, G]`` packed along the output, also
  offset (symmetric: no zero point, i.e. ``2**(bits - 1)`` unsigned); ``weight_g_idx``
  ``[in]`` with act-order "group" (else group ``i // group_size``); ``weight_shape``
  ``[out, in]``. ``W[o, i] = (q[o, i] - z[o, g]) * s[o, g]``.

Each format's tensor names and readers are a ``PackedFormat`` (``FORMATS``).

Refused by name: other bit widths, AWQ without zero points or in another ``version``, a
quantized LM head (GPTQ's ``lm_head``), per-module overrides (GPTQModel's ``dynamic``,
AWQ's ``modules_to_not_convert`` naming more than the LM head), compressed-tensors groups
other than one of integer weights on every linear layer with unquantized activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.model.quant.config_fields import check_ignored, linear_group, refuse
from tpserve.model.quant.wna16 import BITS, pack_factor, unpack
from tpserve.parallel.shard import TensorSource

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of each 4-bit field of an AWQ int32


def check_gptq(qc: dict[str, Any]) -> dict[str, Any]:
    """The fields of a GPTQ ``quantization_config`` that serve it: ``bits``,
    ``group_size``, ``zero_offset`` (1 for v1 checkpoints), ``act_order``."""
    bits = _bits(qc, "bits")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", fmt, "tpserve reads 'gptq' (v1) and 'gptq_v2' "
                     "packing")
    if qc.get("lm_head"):
        raise refuse("lm_head", qc["lm_head"], "tpserve serves the LM head unquantized")
    if qc.get("dynamic"):
        raise refuse("dynamic", qc["dynamic"], "per-module quantization overrides")
    return dict(bits=bits, group_size=_group_size(qc, "group_size"),
                zero_offset=1 if fmt == "gptq" else 0, act_order=bool(qc.get("desc_act")))


def check_awq(qc: dict[str, Any]) -> dict[str, Any]:
    """The same fields for an AWQ ``quantization_config``."""
    bits = _bits(qc, "bits" if "bits" in qc else "w_bit")
    if bits != 4:
        raise refuse("bits", bits, "AWQ checkpoints are served in 4 bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse("version", qc.get("version"), "tpserve reads AutoAWQ's 'gemm' packing")
    if not qc.get("zero_point", True):
        raise refuse("zero_point", qc["zero_point"], "AWQ without zero points")
    check_ignored("modules_to_not_convert", qc.get("modules_to_not_convert"), "quantized")
    gs_field = "group_size" if "group_size" in qc else "q_group_size"
    return dict(bits=bits, group_size=_group_size(qc, gs_field), zero_offset=0,
                act_order=False)


def check_compressed_int(qc: dict[str, Any]) -> dict[str, Any] | None:
    """The same fields (and ``symmetric``) for a compressed-tensors ``pack-quantized``
    config; None for any other compressed-tensors format (its FP8 reader checks it)."""
    if qc.get("format") != "pack-quantized":
        return None
    field, group = linear_group(qc, "integer")
    w = group.get("weights") or {}
    if w.get("type") != "int" or w.get("dynamic", False) or w.get("strategy") not in (
            "group", "channel"):
        raise refuse(f"{field}.weights", w, "tpserve serves static integer weights with "
                     "group or channel scales in the pack-quantized format")
    bits = _bits(w, "num_bits", f"{field}.weights.")
    gs = _group_size(w, "group_size", f"{field}.weights.") if w["strategy"] == "group" else -1
    if gs == -1 and w["strategy"] == "group":
        raise refuse(f"{field}.weights.group_size", -1, "a group strategy needs a size")
    act_order = w.get("actorder")
    if act_order not in (None, "group", "weight", "static", "dynamic"):
        raise refuse(f"{field}.weights.actorder", act_order, "unknown ordering")
    for other in ("input_activations", "output_activations"):
        if group.get(other) is not None:
            raise refuse(f"{field}.{other}", group[other], "integer weights are served "
                         "with unquantized activations (W4A16 / W8A16)")
    check_ignored("ignore", qc.get("ignore"), "quantized")
    return dict(bits=bits, group_size=gs, zero_offset=0,
                act_order=act_order in ("group", "dynamic"),
                symmetric=bool(w.get("symmetric", True)))


def _bits(qc: dict[str, Any], field: str, where: str = "") -> int:
    """``qc[field]``, 4 or 8; ``where``: the path of ``qc`` in the config, for the error."""
    bits = qc.get(field)
    if bits not in BITS or isinstance(bits, bool):
        raise refuse(where + field, bits, f"tpserve serves {' or '.join(map(str, BITS))}"
                     "-bit integer weights")
    return int(bits)


def _group_size(qc: dict[str, Any], field: str, where: str = "") -> int:
    gs = qc.get(field, -1)
    if isinstance(gs, bool) or not isinstance(gs, int) or not (gs == -1 or gs > 0):
        raise refuse(where + field, gs, "expected a positive number of input columns per "
                     "group, or -1 (one group per output row)")
    return gs


class CodesSource:
    """A packed int32 checkpoint tensor read as its integers in the layers' ``[out, in]``
    orientation (the checkpoint's ``[in, out]`` transposed), unsigned ``0 .. 2**bits - 1``,
    int16. ``packed_dim`` is the checkpoint dim the codes are packed along (0: GPTQ's
    ``qweight``; 1: the others); ``order[j]``: the position within its pack of the code in
    bit field ``j`` (AWQ's interleave; identity otherwise). A read covers the whole int32s
    around the requested range and narrows them, so any range may be read."""

    def __init__(self, source: TensorSource, bits: int, packed_dim: int,
                 order: tuple[int, ...] | None = None):
        self.source, self.bits, self.packed_dim = source, bits, packed_dim
        self.pack = pack_factor(bits)
        self.order = order
        if len(source.shape) != 2:
            raise ValueError(f"a packed tensor of shape {tuple(source.shape)}; expected 2-d")
        rows, cols = source.shape
        unpacked = (rows * self.pack, cols) if packed_dim == 0 else (rows, cols * self.pack)
        self.shape = (unpacked[1], unpacked[0])  # [out, in]

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self._unpack(self.source.read()).t().contiguous()
        dim %= 2
        length = self.shape[dim] - start if length is None else length
        theirs = 1 - dim
        if theirs != self.packed_dim:
            return self._unpack(self.source.read(theirs, start, length)).t().contiguous()
        first, last = start // self.pack, -(-(start + length) // self.pack)
        codes = self._unpack(self.source.read(theirs, first, last - first))
        codes = codes.narrow(theirs, start - first * self.pack, length)
        return codes.t().contiguous()

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if packed.dtype != torch.int32:
            raise ValueError(f"a packed tensor stored as {packed.dtype}; expected int32")
        return unpack(packed, self.bits, self.packed_dim, self.order).to(torch.int16)


class TransposedSource:
    """A 2-d checkpoint tensor read transposed (``scales [G, out]`` as ``[out, G]``, so the
    layers' output-row loaders shard it)."""

    def __init__(self, source: TensorSource):
        if len(source.shape) != 2:
            raise ValueError(f"a tensor of shape {tuple(source.shape)}; expected 2-d")
        self.source = source
        self.shape = (source.shape[1], source.shape[0])

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        if dim is None:
            return self.source.read().t().contiguous()
        dim %= 2
        return self.source.read(1 - dim, start, length).t().contiguous()


class OffsetCodesSource:
    """compressed-tensors' ``[out, in / pack]`` (or ``[out / pack, G]``) packed codes read
    as ``[out, in]`` (``[out, G]``) unsigned integers, without the transpose of the other
    formats' ``[in, out]`` tensors (a ``CodesSource`` of the transposed tensor)."""

    def __init__(self, source: TensorSource, bits: int, packed_dim: int):
        self.inner = CodesSource(TransposedSource(source), bits, 1 - packed_dim)
        self.shape = self.inner.shape

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        return self.inner.read(dim, start, length)


@dataclass(frozen=True)
class PackedFormat:
    """One checkpoint format's tensor names (``g_idx`` None: never stored; ``zeros``: the
    name of the zero points, absent in symmetric compressed-tensors checkpoints;
    ``shape``: a tensor of the unsharded ``[out, in]`` that is checked and dropped) and
    the readers that present them as the layers' ``[out, in]`` codes, ``[out, G]`` zero
    points and ``[out, G]`` scales (``Callable[[source, bits], TensorSource]``)."""

    codes: str
    zeros: str
    scales: str
    g_idx: str | None
    shape: str | None
    read_codes: Callable[[TensorSource, int], Any]
    read_zeros: Callable[[TensorSource, int], Any]
    read_scales: Callable[[TensorSource], Any]


FORMATS = {
    "gptq": PackedFormat("qweight", "qzeros", "scales", "g_idx", None,
                         lambda src, bits: CodesSource(src, bits, 0),
                         lambda src, bits: CodesSource(src, bits, 1), TransposedSource),
    "awq": PackedFormat("qweight", "qzeros", "scales", None, None,
                        lambda src, bits: CodesSource(src, bits, 1, AWQ_ORDER),
                        lambda src, bits: CodesSource(src, bits, 1, AWQ_ORDER),
                        TransposedSource),
    "compressed-tensors": PackedFormat(
        "weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx", "weight_shape",
        lambda src, bits: OffsetCodesSource(src, bits, 1),
        lambda src, bits: OffsetCodesSource(src, bits, 0), lambda src: src),
    # a GGUF file's integer blocks, presented as [out, in] codes and [out, G] zero points
    # (or offsets) and scales by ``loader/gguf_integer.py``'s sources
    "gguf": PackedFormat("gguf_codes", "gguf_zeros", "gguf_scales", None, None,
                         lambda src, bits: src, lambda src, bits: src, lambda src: src),
}

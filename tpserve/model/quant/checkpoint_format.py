"""A checkpoint's own quantization: ``config.json``'s ``quantization_config``, read once when
the folder is opened (no weights read), into ``CheckpointQuantization``, or refused with a
ValueError naming the method or the field.

Served as stored (``model/quant/fp8_checkpoint.py``: the checkpoint's e4m3 codes are the
served weights):
- ``quant_method: "fp8"`` (vLLM's ``Fp8Config``: AutoFP8 and llm-compressor exports such as
  ``neuralmagic/*-FP8``) with ``activation_scheme`` "dynamic" or "static", and
  ``ignored_layers`` naming at most the LM head; with ``weight_block_size [bn, bk]``
  (transformers' FineGrainedFP8, vLLM's block-wise FP8) the activations must be dynamic;
- ``quant_method: "compressed-tensors"`` whose one config group holds 8-bit float weights
  (``strategy`` "tensor" or "channel", symmetric, static) and no input activations, dynamic
  8-bit float ones, or static 8-bit float ones with one scale per tensor (``strategy``
  "tensor"), ``format`` "float-quantized" or "naive-quantized", no sparsity, and ``ignore``
  naming at most the LM head (``*-FP8-dynamic`` and ``*-FP8`` checkpoints); or block
  weights (``strategy`` "block", ``block_structure [bn, bk]``) with dynamic activations
  per group of ``bk`` (llm-compressor's ``FP8_BLOCK``).
Tensors: ``*.weight`` in ``float8_e4m3fn``, ``*.weight_scale`` one float32 per tensor
(shape ``[]`` or ``[1]``) or per output row (``[out]`` or ``[out, 1]``); with static
activations also ``*.input_scale``, one float per tensor (``static_activations``: every
W8A8 product quantizes its input with it, see ``Fp8CheckpointMethod``). Block-wise:
``*.weight_scale_inv`` (``fp8``) or ``*.weight_scale`` (compressed-tensors), ``[ceil(out /
bn), ceil(in / bk)]`` (``weight_block``, ``scale_name``; see ``fp8_block.py``). ``bk`` must
be a power of two of at least 16 (it is the kernels' K step).

Served as stored with integer weights (``model/quant/wna16_method.py``): ``quant_method``
"gptq" and "awq", and "compressed-tensors" of ``format`` "pack-quantized", 4 or 8 bits with
group scales and zero points (``int_checkpoint.py`` checks their fields and reads their
packed tensors).

Refused: any other method (bitsandbytes, ...), block-wise scales with static activations,
and static activation scales other than one per tensor.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpserve.model.quant.config_fields import check_ignored, linear_group, refuse
from tpserve.model.quant.int_checkpoint import check_awq, check_compressed_int, check_gptq

SERVED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
# files older GPTQ/AWQ exports keep their settings in instead of config.json
SIDE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's linear weights are: ``method`` is the ``--quantization`` value
    that serves them ("fp8", "gptq", "awq"); ``quant_method`` as ``config.json`` spells it;
    ``static_activations``: the activations' scales are the checkpoint's (``input_scale``,
    one per tensor, calibrated offline) rather than computed per token at run time.
    Integer weights (GPTQ, AWQ): ``bits``, ``group_size`` (-1: one group per row),
    ``zero_offset`` (added to every stored zero point: 1 in GPTQ's v1 format),
    ``act_order`` (GPTQ's ``desc_act``: groups in any column order), ``symmetric`` (no
    zero points stored: compressed-tensors). ``dequantizable``: a GGUF file whose weights
    the WNA16 method can serve as stored (``--quantization gguf``), while every other
    choice (``auto`` and ``none`` included) dequantizes them at load, as before;
    ``offset``: its zero points are float offsets added after the scale (``Q4_1``, the
    K-quants). A GGUF file's ``block_types``: ``(type, tensors)`` of its decoder linear
    weights; ``modules``: ``(layer, module, bits, group_size, offset)`` of each decoder
    linear module where they differ (``loader/gguf_integer.Form``; ``bits``, ``group_size``
    and ``offset`` then give the widest, the smallest and any), else empty;
    ``linear_weights``: their elements, ``stored_bytes``: what they take served as stored
    (every rank together, 16-bit scales; ``describe_dequantized``)."""

    method: str
    quant_method: str
    static_activations: bool = False
    weight_block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    bits: int | None = None
    group_size: int = -1
    zero_offset: int = 0
    act_order: bool = False
    symmetric: bool = False
    dequantizable: bool = False
    offset: bool = False
    block_types: tuple[tuple[str, int], ...] = ()
    modules: tuple[tuple[int, str, int, int, bool], ...] = ()
    linear_weights: int = 0
    stored_bytes: int = 0

    def describe_dequantized(self, dtype_bytes: int, dtype: str) -> str:
        """A GGUF file served dequantized (``--quantization auto``): what its linear
        weights take so and as stored (``--quantization gguf``)."""
        gib = 2.0**30
        return (f"the GGUF file's blocks ({self._block_counts()})"
                f" dequantized to {dtype} at load: {self.dequantized_bytes(dtype_bytes) / gib:.2f}"
                f" GiB over all ranks; --quantization gguf serves them as stored in "
                f"{self.stored_bytes / gib:.2f} GiB")

    def dequantized_bytes(self, dtype_bytes: int) -> int:
        """What a GGUF file's linear weights take dequantized to a dtype of
        ``dtype_bytes`` (every rank together)."""
        return self.linear_weights * dtype_bytes

    def _block_counts(self) -> str:
        return ", ".join(f"{n} x {kind}" for kind, n in self.block_types)

    def describe(self) -> str:
        if self.method == "gguf":
            types = self._block_counts() or self.quant_method
            if not self.modules:
                return (f"the GGUF file's blocks ({types}), {self.bits}-bit, groups of "
                        f"{self.group_size}" + (", offsets" if self.offset else ""))
            forms = Counter(f"{b}-bit groups of {g}" + (" with offsets" if o else "")
                            for _, _, b, g, o in self.modules)
            return (f"the GGUF file's blocks ({types}) in {len(self.modules)} modules: "
                    + ", ".join(f"{n} in {f}" for f, n in sorted(forms.items())))
        integer = ""
        if self.bits is not None:
            integer = (f", {self.bits}-bit, " + ("one group per row" if self.group_size == -1
                                                 else f"groups of {self.group_size}")
                       + (", act-order" if self.act_order else "")
                       + (", symmetric" if self.symmetric else ""))
        return (f"quantization_config.quant_method {self.quant_method!r}"
                + (", static activation scales" if self.static_activations else "")
                + (f", block-wise weight scales {list(self.weight_block)}"
                   if self.weight_block else "") + integer)


def read_checkpoint_quantization(config: dict[str, Any], folder: Path | None = None
                                 ) -> CheckpointQuantization | None:
    """None for an unquantized checkpoint; the served quantization; or ValueError naming the
    unsupported method or field."""
    qc = config.get("quantization_config")
    if qc is None:
        qc = _side_config(folder)
        if qc is None:
            return None
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        fields = check_gptq(qc) if method == "gptq" else check_awq(qc)
        return CheckpointQuantization(method, method, **fields)
    integer = check_compressed_int(qc) if method == "compressed-tensors" else None
    if integer is not None:
        return CheckpointQuantization(method, method, **integer)
    if method == "fp8":
        static, block = _check_fp8(qc)
        scale_name = "weight_scale_inv" if block else "weight_scale"
    elif method == "compressed-tensors":
        static, block = _check_compressed_tensors(qc)
        scale_name = "weight_scale"
    else:
        raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not "
                         f"supported; tpserve serves {', '.join(map(repr, SERVED_METHODS))} "
                         "(FP8 e4m3 weights with per-tensor, per-channel or block scales; "
                         "4- or 8-bit integer weights with group scales)")
    return CheckpointQuantization("fp8", method, static, block, scale_name)


def _side_config(folder: Path | None) -> dict[str, Any] | None:
    """The settings of an older GPTQ / AWQ export that keeps them beside config.json
    (AutoGPTQ's ``quantize_config.json``, AutoAWQ's ``quant_config.json``), as vLLM reads
    them: the file's ``quant_method``, else AWQ where the file is AutoAWQ's (its name, or
    its ``w_bit`` / ``zero_point`` fields), else GPTQ."""
    for name in SIDE_CONFIG_FILES:
        path = None if folder is None else folder / name
        if path is None or not path.is_file():
            continue
        try:
            qc = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(qc, dict):
            raise ValueError(f"{path}: expected a JSON object")
        awq = name == "quant_config.json" or "w_bit" in qc or "zero_point" in qc
        return {"quant_method": "awq" if awq else "gptq", **qc}
    return None


def _block_size(field: str, block: Any) -> tuple[int, int]:
    """``[bn, bk]``: positive ints, ``bk`` a power of two >= 16."""
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
            and block[1] >= 16 and block[1] & (block[1] - 1) == 0):
        raise refuse(field, block, "expected [rows, columns] of a weight block, the columns "
                     "a power of two of at least 16 (e.g. [128, 128])")
    return int(block[0]), int(block[1])


def _check_fp8(qc: dict[str, Any]) -> tuple[bool, tuple[int, int] | None]:
    """Whether the activation scales are static, and the weight block (None: per tensor or
    per channel)."""
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise refuse("activation_scheme", scheme, "expected 'dynamic' (activations scaled "
                     "per token at run time) or 'static' (the checkpoint's input_scale)")
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block_size("weight_block_size", block)
        if scheme != "dynamic":
            raise refuse("activation_scheme", scheme, "block-wise weight scales take "
                         "dynamic activation scales (per token and group), as in vLLM")
    check_ignored("ignored_layers", qc.get("ignored_layers"), "in FP8 or none")
    return scheme == "static", block


def _check_compressed_tensors(qc: dict[str, Any]) -> tuple[bool, tuple[int, int] | None]:
    """Whether the activation scales are static, and the weight block (None: per tensor or
    per channel)."""
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise refuse("format", fmt, "tpserve serves compressed-tensors FP8 "
                     "('float-quantized') checkpoints only")
    field, group = linear_group(qc, "FP8")
    w = group.get("weights") or {}
    if not (w.get("type") == "float" and w.get("num_bits") == 8
            and w.get("strategy") in ("tensor", "channel", "block") and w.get("symmetric", True)
            and not w.get("dynamic", False)):
        raise refuse(f"{field}.weights", w, "tpserve serves 8-bit float "
                     "weights with per-tensor, per-channel or block ('tensor'/'channel'/"
                     "'block') scales")
    block = (_block_size(f"{field}.weights.block_structure",
                         w.get("block_structure")) if w["strategy"] == "block" else None)
    a = group.get("input_activations")
    static = a is not None and a.get("dynamic") is False
    if a is not None and not (a.get("type") == "float" and a.get("num_bits") == 8
                              and a.get("symmetric", True)
                              and (a.get("dynamic") is True
                                   or (static and a.get("strategy") == "tensor"))):
        raise refuse(f"{field}.input_activations", a, "tpserve serves 8-bit "
                     "float input activations, dynamic (scaled per token at run time) or "
                     "static with one scale per tensor (strategy 'tensor', input_scale)")
    if block is not None and not (a is not None and a.get("dynamic") is True
                                  and a.get("strategy") == "group"
                                  and a.get("group_size") == block[1]):
        raise refuse(f"{field}.input_activations", a, "block-wise weights "
                     f"take dynamic activations per group of {block[1]} columns (strategy "
                     f"'group', group_size {block[1]}: the block's columns)")
    if group.get("output_activations") is not None:
        raise refuse(f"{field}.output_activations",
                     group["output_activations"], "output activations are not quantized")
    check_ignored("ignore", qc.get("ignore"), "in FP8 or none")
    return static, block

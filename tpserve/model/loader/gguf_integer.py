"""GGUF block types served as stored (``--quantization gguf``; ``gguf_blocks.py`` lists
them: ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1`` and ``Q2_K`` .. ``Q6_K``): their
blocks are integer codes with a float scale per group of input columns and a zero point or
a float offset, the WNA16 layout (``model/quant/wna16.py``).

Each decoder layer's linear module (q/k/v, o, gate/up, down) takes one ``Form``: codes of 4
bits where every part's type has at most 4 (a 2- or 3-bit code in 4 bits), else 8 (a 5- or
6-bit code in a byte); the smallest group of its parts' types (16 for ``Q2_K``, ``Q3_K`` and
``Q6_K``, else 32); and the type's own zero point (``Q8_0`` 128, ``Q4_0`` 8, ``Q5_0`` 16,
``Q3_K`` 4, ``Q6_K`` 32) where all its parts are of one such type, else float offsets after
the scale (``W = q * s + z``: an integer zero point becomes the offset ``-zero * s``, exact
in float32). So a file that mixes types by tensor, as llama.cpp's ``Q4_K_M`` (``Q6_K`` for
some ``attn_v`` and ``ffn_down``) and ``Q5_K_M`` do, is served with a method per module
(``quant.methods.ModuleMethods``); a file whose modules all take one form, with one
``Wna16Method``. A fused module takes its widest part's width (a ``Q4_K_M`` q/k/v with its
``Q6_K`` v: 8 bits, groups of 16, offsets). In float32 the served weights equal the file's
dequantized ones (``gguf.quants.dequantize``, the default path) bit for bit; in a 16-bit
dtype see ``gguf_blocks.py``.

A file serves as stored only when every linear weight of its decoder layers is of one of
these types and none is Phi-3's fused ``attn_qkv`` (``stored_integer``); a mixture of
experts' experts have no WNA16 product (the model refuses the method). Embeddings, the LM
head and norms are dequantized as before.

The sources present a tensor as the WNA16 loader reads a checkpoint's
(``int_checkpoint.FORMATS["gguf"]``): codes ``[out, in]`` (int16, unsigned), scales and
zero points (or offsets) ``[out, in / group]``, in rows as Hugging Face orders them
(llama.cpp's q/k row permutation undone, as ``gguf_file.GGUFSource`` does for floats).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.model.loader import gguf_blocks
from tpserve.model.loader.gguf_blocks import BLOCK_TYPES
from tpserve.model.quant.checkpoint_format import CheckpointQuantization

# the decoder layers' linear weights (llama.cpp's names; experts and Phi-3's fused tensors
# excluded: the WNA16 method serves neither) and the module that holds each
LINEAR = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)"
                    r"\.weight")
MODULES = {"attn_q": "qkv_proj", "attn_k": "qkv_proj", "attn_v": "qkv_proj",
           "attn_output": "o_proj", "ffn_gate": "gate_up_proj", "ffn_up": "gate_up_proj",
           "ffn_down": "down_proj"}
SUFFIXES = ("gguf_codes", "gguf_scales", "gguf_zeros")
# Phi-3's fused q/k/v (its ``ffn_up`` holds gate and up): loaded part by part, not served
FUSED = re.compile(r"blk\.\d+\.attn_qkv\.weight")


@dataclass(frozen=True)
class Form:
    """How a module's weights are served: ``bits`` per code (4 or 8), ``group`` input
    columns per scale, ``offset``: float offsets after the scale rather than the one type's
    integer zero point."""

    bits: int
    group: int
    offset: bool


def module_forms(tensors) -> dict[tuple[int, str], Form] | None:
    """``(layer, module) -> Form`` for a file whose decoder linear weights are all of the
    served types (``gguf_blocks.BLOCK_TYPES``), else None."""
    kinds: dict[tuple[int, str], set[str]] = {}
    for t in tensors:
        if FUSED.fullmatch(t.name):
            return None
        m = LINEAR.fullmatch(t.name)
        if m is not None:
            kinds.setdefault((int(m[1]), MODULES[m[2]]), set()).add(t.tensor_type.name)
    if not kinds or any(k not in BLOCK_TYPES for ks in kinds.values() for k in ks):
        return None
    forms = {}
    for key, ks in kinds.items():
        types = [BLOCK_TYPES[k] for k in ks]
        forms[key] = Form(4 if all(t.bits <= 4 for t in types) else 8,
                          min(t.group for t in types),
                          len(types) > 1 or types[0].zero is None)
    return forms


def stored_integer(tensors) -> CheckpointQuantization | None:
    """The WNA16 quantization of a file whose decoder linear weights are all of the served
    types (``dequantizable``: ``--quantization auto`` still dequantizes them at load), else
    None; ``modules`` lists each module's form where they differ."""
    forms = module_forms(tensors)
    if forms is None:
        return None
    # the linear weights' types, elements, and bytes as stored (16-bit scales and offsets,
    # 8-bit zero points)
    counts: Counter[str] = Counter()
    weights = stored = 0
    for t in tensors:
        m = LINEAR.fullmatch(t.name)
        if m is not None:
            form = forms[(int(m[1]), MODULES[m[2]])]
            n = int(np.prod([int(x) for x in t.shape]))
            counts[t.tensor_type.name] += 1
            weights += n
            stored += n * form.bits // 8 + n // form.group * (2 + (2 if form.offset else 1))
    distinct = set(forms.values())
    modules = (() if len(distinct) == 1 else
               tuple(sorted((layer, name, f.bits, f.group, f.offset)
                            for (layer, name), f in forms.items())))
    return CheckpointQuantization(
        "gguf", "+".join(sorted(counts)), bits=max(f.bits for f in distinct),
        group_size=min(f.group for f in distinct), dequantizable=True,
        offset=any(f.offset for f in distinct), modules=modules,
        block_types=tuple(sorted(counts.items())), linear_weights=weights,
        stored_bytes=stored)


def unpermute_rows(w: torch.Tensor, heads: int, rows: int, row_start: int) -> torch.Tensor:
    """llama.cpp's per-head interleaving of q/k rows undone for the whole heads in ``w``
    (rows ``row_start ..`` of a tensor of ``rows`` rows and ``heads`` heads)."""
    head_dim = rows // heads
    if row_start % head_dim or w.shape[0] % head_dim:
        raise ValueError("GGUF q/k shards must be whole heads")
    n = w.shape[0] // head_dim
    return w.reshape(n, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFBlocks:
    """One tensor's blocks served in its module's ``form``; ``part`` "codes", "scales" or
    "zeros" (float32 offsets in an offset form, else the type's zero point as uint8) is what
    ``read`` returns (a ``TensorSource``: rows along dim 0, input columns or the form's
    groups along dim 1). A type with groups larger than the form's (32 in a form of 16)
    repeats each scale and offset."""

    def __init__(self, tensor, part: str, unpermute_heads: int | None, form: Form):
        self.data = tensor.data  # uint8 [rows, blocks * bytes per block]
        self.kind = tensor.tensor_type.name
        self.type = BLOCK_TYPES[self.kind]
        self.form = form
        rows, cols = (int(x) for x in reversed(tensor.shape))
        if cols % self.type.columns:
            raise ValueError(f"{tensor.name}: {cols} columns are not whole blocks")
        self.part = part
        self.unit = 1 if part == "codes" else form.group  # columns per element read
        self.shape = (rows, cols // self.unit)
        self.unpermute_heads = unpermute_heads

    def read(self, dim: int | None = None, start: int = 0,
             length: int | None = None) -> torch.Tensor:
        data = self.data
        row_start = 0
        if dim is not None:
            dim %= 2
            length = self.shape[dim] - start if length is None else length
        narrow = None
        if dim == 0:
            data, row_start = data[start:start + length], start
        elif dim == 1:
            per = self.type.columns // self.unit  # elements per block
            first, last = start // per, -(-(start + length) // per)
            data = data[:, first * self.type.nbytes:last * self.type.nbytes]
            narrow = (start - first * per, length)
        out = self._decode(np.asarray(data))
        if narrow is not None:
            out = out.narrow(1, *narrow)
        if self.unpermute_heads is not None:
            out = unpermute_rows(out, self.unpermute_heads, self.shape[0], row_start)
        return out.contiguous()

    def _decode(self, data: np.ndarray) -> torch.Tensor:
        """This part of the blocks in ``data`` (rows of whole blocks, a view of the file)."""
        rows = data.shape[0]
        blocks = data.reshape(rows, -1, self.type.nbytes)
        if self.part == "codes":
            return torch.from_numpy(gguf_blocks.codes(self.kind, blocks))
        repeat = self.type.group // self.form.group
        if self.part == "zeros" and not self.form.offset:
            groups = blocks.shape[1] * self.type.columns // self.form.group
            return torch.full((rows, groups), self.type.zero, dtype=torch.uint8)
        if self.part == "scales" or self.type.zero is not None:
            values = gguf_blocks.scales(self.kind, blocks)
            if self.part == "zeros":  # an integer zero point as the offset -zero * scale
                values = values * np.float32(-self.type.zero)
        else:
            values = gguf_blocks.offsets(self.kind, blocks)
        return torch.from_numpy(np.repeat(values, repeat, axis=1) if repeat > 1 else values)

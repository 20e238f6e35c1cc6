"""GGUF ``Q8_0``, ``Q4_0`` and ``Q4_1`` weights served as stored (``--quantization gguf``):
their blocks are integer codes with one fp16 scale per 32 input columns and a zero point or
an offset, which is the WNA16 layout (``model/quant/wna16.py``) exactly:

- ``Q8_0``: a block is ``d`` (fp16) and 32 signed bytes ``q``; ``w = d * q``. Served as
  8-bit code ``q + 128`` with zero point 128 and scale ``d``.
- ``Q4_0``: a block is ``d`` and 16 bytes, element ``j`` the low nibble of byte ``j``,
  element ``16 + j`` its high nibble; ``w = d * (q - 8)``. Served as 4-bit code ``q`` with
  zero point 8 and scale ``d``.
- ``Q4_1``: ``d``, ``m`` (fp16) and 16 bytes of nibbles as ``Q4_0``'s; ``w = d * q + m``.
  Served as code ``q``, scale ``d`` and the float offset ``m`` (the WNA16 ``offset`` form).

``(code - zero) * d`` is an integer times an fp16 scale, exact in float32, and so is
``q * d`` before the one rounding of ``+ m``, so the served weights round to the model's
dtype exactly as the file's dequantized weights do (``gguf.quants.dequantize``, the default
path). The K-quants (6-bit sub-block scales under an fp16 one) are not this layout; a file
serves as stored only when every linear weight of its decoder layers is one of these three
types, the same one, and none is Phi-3's fused ``attn_qkv`` (``stored_integer``); a mixture
of experts' experts have no WNA16 product (the model refuses the method). Embeddings, the
LM head and norms are dequantized as before.

The sources present a tensor as the WNA16 loader reads a checkpoint's
(``int_checkpoint.FORMATS["gguf"]``): codes ``[out, in]`` (int16, unsigned), scales and
zero points ``[out, in / 32]``, in rows as Hugging Face orders them (llama.cpp's q/k
row permutation undone, as ``gguf_file.GGUFSource`` does for floats).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from tpserve.model.quant.checkpoint_format import CheckpointQuantization

BLOCK = 32  # input columns per block: the group size
# GGML type name -> (bits, zero point (None: an fp16 offset after the scale), bytes per block)
TYPES = {"Q8_0": (8, 128, 34), "Q4_0": (4, 8, 18), "Q4_1": (4, None, 20)}
# the decoder layers' linear weights (llama.cpp's names; experts and Phi-3's fused tensors
# excluded: the WNA16 method serves neither)
LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)"
                    r"\.weight")
SUFFIXES = ("gguf_codes", "gguf_scales", "gguf_zeros")
# Phi-3's fused q/k/v (its ``ffn_up`` holds gate and up): loaded part by part, not served
FUSED = re.compile(r"blk\.\d+\.attn_qkv\.weight")


def stored_integer(tensors) -> CheckpointQuantization | None:
    """The WNA16 quantization of a file whose decoder linear weights are all ``Q8_0``, all
    ``Q4_0`` or all ``Q4_1`` (``dequantizable``: ``--quantization auto`` still dequantizes
    them at load), else None."""
    kinds = {t.tensor_type.name for t in tensors if LINEAR.fullmatch(t.name)}
    if len(kinds) != 1 or next(iter(kinds)) not in TYPES:
        return None
    if any(FUSED.fullmatch(t.name) for t in tensors):
        return None
    name = next(iter(kinds))
    bits, zero, _ = TYPES[name]
    return CheckpointQuantization("gguf", name, bits=bits, group_size=BLOCK,
                                  dequantizable=True, offset=zero is None)


def unpermute_rows(w: torch.Tensor, heads: int, rows: int, row_start: int) -> torch.Tensor:
    """llama.cpp's per-head interleaving of q/k rows undone for the whole heads in ``w``
    (rows ``row_start ..`` of a tensor of ``rows`` rows and ``heads`` heads)."""
    head_dim = rows // heads
    if row_start % head_dim or w.shape[0] % head_dim:
        raise ValueError("GGUF q/k shards must be whole heads")
    n = w.shape[0] // head_dim
    return w.reshape(n, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFBlocks:
    """One ``Q8_0`` / ``Q4_0`` / ``Q4_1`` tensor's blocks; ``part`` "codes", "scales" or
    "zeros" (``Q4_1``: its fp16 offsets) is what ``read`` returns (a ``TensorSource``: rows
    along dim 0, input columns or groups along dim 1)."""

    def __init__(self, tensor, part: str, unpermute_heads: int | None):
        self.data = tensor.data  # uint8 [rows, blocks * bytes per block]
        self.kind = tensor.tensor_type.name
        self.bits, self.zero, self.block_bytes = TYPES[self.kind]
        rows, cols = (int(x) for x in reversed(tensor.shape))
        if cols % BLOCK:
            raise ValueError(f"{tensor.name}: {cols} columns are not whole blocks")
        self.part = part
        self.shape = (rows, cols) if part == "codes" else (rows, cols // BLOCK)
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
            per = BLOCK if self.part == "codes" else 1  # columns per block
            first, last = start // per, -(-(start + length) // per)
            data = data[:, first * self.block_bytes:last * self.block_bytes]
            narrow = (start - first * per, length)
        out = self._decode(data)
        if narrow is not None:
            out = out.narrow(1, *narrow)
        if self.unpermute_heads is not None:
            out = unpermute_rows(out, self.unpermute_heads, self.shape[0], row_start)
        return out.contiguous()

    def _decode(self, data: np.ndarray) -> torch.Tensor:
        """This part of the blocks in ``data`` (rows of whole blocks, a view of the file):
        only the bytes the part needs are read (none for a fixed zero point)."""
        rows = data.shape[0]
        if self.part == "zeros" and self.zero is not None:
            return torch.full((rows, data.shape[1] // self.block_bytes), self.zero,
                              dtype=torch.uint8)
        blocks = data.reshape(rows, -1, self.block_bytes)
        if self.part != "codes":  # the fp16 d, or Q4_1's offset m after it
            at = 0 if self.part == "scales" else 2
            half = np.ascontiguousarray(blocks[:, :, at:at + 2]).view(np.float16)[..., 0]
            return torch.from_numpy(half.copy())
        qs = blocks[:, :, 2 if self.zero is not None else 4:]
        if self.kind == "Q8_0":
            codes = qs.view(np.int8).astype(np.int16) + self.zero
        else:  # low nibbles are the block's first 16 elements, high nibbles the last 16
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
        return torch.from_numpy(codes.reshape(rows, -1))

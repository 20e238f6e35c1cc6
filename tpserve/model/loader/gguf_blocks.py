"""The GGML block types whose weights the WNA16 method serves as stored (``--quantization
gguf``), and how a tensor's blocks split into integer codes, float32 scales and zero points
or float offsets, one scale (and offset) per ``group`` input columns:

- ``Q8_0`` (34 bytes / 32 columns): fp16 ``d``, 32 signed bytes; ``w = d * q``: code
  ``q + 128``, zero point 128.
- ``Q4_0`` (18 / 32): ``d``, 16 bytes of nibbles (element ``j`` the low nibble of byte
  ``j``, element ``16 + j`` its high nibble); ``w = d * (q - 8)``.
- ``Q4_1`` (20 / 32): ``d``, fp16 ``m``, nibbles as ``Q4_0``'s; ``w = d * q + m``.
- ``Q5_0`` / ``Q5_1`` (22 / 24 per 32): as ``Q4_0`` / ``Q4_1`` with a fifth bit per element
  (bit ``j`` of a little-endian uint32 before the nibbles); zero point 16 / offset ``m``.
- ``Q4_K`` (144 / 256): fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and
  mins ``m`` (one per 32 columns), 128 bytes of nibbles (sub-blocks ``2c`` and ``2c + 1`` the
  low and high nibbles of bytes ``32c ..``); ``w = (d * sc) * q - dmin * m``.
- ``Q5_K`` (176 / 256): ``Q4_K`` with a fifth bit (bit ``i`` of byte ``l`` of 32 bytes
  before the nibbles: sub-block ``i``'s element ``l``).
- ``Q6_K`` (210 / 256): 128 bytes of low nibbles, 64 of 2-bit high parts, 16 signed 8-bit
  scales (one per 16 columns), fp16 ``d``; ``w = (d * sc) * (q - 32)``.
- ``Q3_K`` (110 / 256): 32 bytes of high bits (bit ``i`` of byte ``l``: sub-block ``i``'s
  element ``l``, 32 columns each), 64 bytes of 2-bit low parts (bits ``2t ..`` of byte
  ``32h + l``: element ``128h + 32t + l``), sixteen 6-bit scales in 12 bytes (one per 16
  columns, less 32), fp16 ``d``; ``w = (d * (sc - 32)) * (q - 4)``.
- ``Q2_K`` (84 / 256): sixteen bytes of a 4-bit scale ``sc`` (low nibble) and min ``m``
  (high nibble) per 16 columns, 64 bytes of 2-bit codes laid out as ``Q3_K``'s low parts,
  fp16 ``d`` and ``dmin``; ``w = (d * sc) * q - dmin * m``.

Every scale is ``d`` (fp16) times a small integer and every K-quant offset ``-dmin * m``,
both exact in float32, and ``gguf.quants.dequantize`` computes the weight from them in the
same order, so in float32 ``(q - zero) * scale`` and ``q * scale + offset`` equal the
package's dequantization bit for bit. In a 16-bit model dtype a K-quant's scales and
offsets are rounded to it once when loaded (they may need 17 significant bits): the served
weight can differ from the file's dequantized one (rounded once) by a unit in the last
place.

The ``IQ`` types (codebooks, not an affine map of integer codes) and ``Q8_K`` are not
served as stored (they are dequantized at load)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockType:
    """``bits`` per code; ``group`` input columns per scale; ``zero``: the fixed zero point,
    or None where each group has a float offset added after the scale; ``columns`` and
    ``nbytes`` of one block; ``halves``: the byte offsets of its fp16 fields, ``d`` first
    (then ``m`` or ``dmin``)."""

    bits: int
    group: int
    zero: int | None
    columns: int
    nbytes: int
    halves: tuple[int, ...]


BLOCK_TYPES = {
    "Q8_0": BlockType(8, 32, 128, 32, 34, (0,)),
    "Q4_0": BlockType(4, 32, 8, 32, 18, (0,)),
    "Q4_1": BlockType(4, 32, None, 32, 20, (0, 2)),
    "Q5_0": BlockType(5, 32, 16, 32, 22, (0,)),
    "Q5_1": BlockType(5, 32, None, 32, 24, (0, 2)),
    "Q2_K": BlockType(2, 16, None, 256, 84, (80, 82)),
    "Q3_K": BlockType(3, 16, 4, 256, 110, (108,)),
    "Q4_K": BlockType(4, 32, None, 256, 144, (0, 2)),
    "Q5_K": BlockType(5, 32, None, 256, 176, (0, 2)),
    "Q6_K": BlockType(6, 16, 32, 256, 210, (208,)),
}


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of every block, as float32 ``[rows, blocks]``."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """``[..., n]`` bytes -> ``[..., 2n]`` 4-bit values, ``chunk`` bytes at a time: their
    low nibbles, then their high ones (the ``_0`` / ``_1`` types: one chunk of 16; ``Q4_K``
    / ``Q5_K``: chunks of 32, a sub-block each half; ``Q6_K``'s low bits: chunks of 64)."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, chunk)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*qs.shape[:-3], -1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """``Q5_0`` / ``Q5_1``: 4 bytes (a little-endian uint32) -> bit ``j`` for element ``j``
    (32), shifted to bit 4."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return (((word >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Q4_K`` / ``Q5_K``: 12 bytes -> the eight 6-bit scales and mins (float32): bytes
    0-3 hold scales 0-3 and the top bits of scales 4-7, bytes 4-7 the same for the mins,
    bytes 8-11 the low nibbles of scales 4-7 and (high nibbles) mins 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q3_scales(packed: np.ndarray) -> np.ndarray:
    """``Q3_K``: 12 bytes -> the sixteen 6-bit scales less 32 (float32): scale ``j``'s low
    four bits are nibble ``j // 8`` of byte ``j % 8``, its top two bits ``2 (j // 4) ..`` of
    byte ``8 + j % 4``."""
    low, high = _nibbles(packed[..., :8], 8), _crumbs(packed[..., 8:12], 4)
    return (low | (high << 4)).astype(np.float32) - 32


def _crumbs(qs: np.ndarray, chunk: int) -> np.ndarray:
    """``[..., n]`` bytes -> ``[..., 4n]`` 2-bit values, ``chunk`` bytes at a time: bits
    ``2t ..`` of the chunk's byte ``l`` are its element ``chunk * t + l`` (``Q2_K`` /
    ``Q3_K``'s low bits and ``Q6_K``'s high bits: chunks of 32; ``Q3_K``'s scales' top bits:
    one chunk of 4)."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, chunk)
    return ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03).reshape(
        *qs.shape[:-3], -1)


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """``Q3_K`` / ``Q5_K``: 32 bytes -> 256 single bits: bit ``i`` of byte ``l`` is element
    ``32i + l``."""
    planes = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return planes.reshape(*qh.shape[:-1], 256)


def codes(kind: str, blocks: np.ndarray) -> np.ndarray:
    """``blocks`` uint8 ``[rows, n, nbytes]`` -> int16 codes ``[rows, n * columns]``
    (unsigned, below ``2**bits``)."""
    rows = blocks.shape[0]
    if kind == "Q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    elif kind in ("Q4_0", "Q4_1"):
        q = _nibbles(blocks[..., 2 if kind == "Q4_0" else 4:], 16)
    elif kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        q = _nibbles(blocks[..., at + 4:], 16) | _fifth_bits(blocks[..., at:at + 4])
    elif kind == "Q4_K":
        q = _nibbles(blocks[..., 16:], 32)
    elif kind == "Q5_K":
        q = _nibbles(blocks[..., 48:], 32) | (_bit_planes(blocks[..., 16:48]) << 4)
    elif kind == "Q2_K":
        q = _crumbs(blocks[..., 16:80], 32)
    elif kind == "Q3_K":  # the high bit set: no -4 (llama.cpp stores it inverted)
        q = _crumbs(blocks[..., 32:96], 32) | (_bit_planes(blocks[..., :32]) << 2)
    elif kind == "Q6_K":
        q = _nibbles(blocks[..., :128], 64) | (_crumbs(blocks[..., 128:192], 32) << 4)
    else:
        raise ValueError(f"GGML type {kind} is not served as stored")
    return q.astype(np.int16).reshape(rows, -1)


def scales(kind: str, blocks: np.ndarray) -> np.ndarray:
    """float32 ``[rows, n * columns / group]``: each group's scale."""
    d = _half(blocks, BLOCK_TYPES[kind].halves[0])
    if kind == "Q6_K":
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    elif kind == "Q2_K":
        sc = (blocks[..., :16] & 0x0F).astype(np.float32)
    elif kind == "Q3_K":
        sc = _q3_scales(blocks[..., 96:108])
    elif kind in ("Q4_K", "Q5_K"):
        sc = _k_scales(blocks[..., 4:16])[0]
    else:  # one scale a block: d itself
        return d
    return (d[..., None] * sc).reshape(blocks.shape[0], -1)


def offsets(kind: str, blocks: np.ndarray) -> np.ndarray:
    """float32 ``[rows, n * columns / group]``: the float offset of each group of a type
    without a zero point (``Q4_1``, ``Q5_1``: ``m``; ``Q4_K``, ``Q5_K``: ``-dmin * m``)."""
    if BLOCK_TYPES[kind].zero is not None:
        raise ValueError(f"GGML type {kind} has a zero point, not offsets")
    m = _half(blocks, BLOCK_TYPES[kind].halves[1])  # m, or dmin
    if kind in ("Q4_K", "Q5_K"):
        mins = _k_scales(blocks[..., 4:16])[1]
    elif kind == "Q2_K":
        mins = (blocks[..., :16] >> 4).astype(np.float32)
    else:  # one offset a block: m itself
        return m
    return -(m[..., None] * mins).reshape(blocks.shape[0], -1)

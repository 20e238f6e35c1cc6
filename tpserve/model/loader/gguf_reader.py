"""A GGUF file's metadata and tensor table, read without materialising big arrays.

``gguf.GGUFReader`` builds a numpy view for every item of every metadata array: for
SmolLM2's 49,152-token vocabulary (tokens, scores, types, merges) that is about 2 s of a
server start, spent twice (the HTTP process reads the config, the engine process the
weights). This reader walks the same layout once with ``struct`` and keeps arrays as
positions: numeric arrays become numpy views on first use, string arrays are decoded only
when asked for. The tensor table matches ``GGUFReader.tensors`` (name, type, GGUF-order
shape, and ``data``: a read-only memmap view shaped like GGUFReader's).

Format (little-endian, versions 2 and 3): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; metadata as (key string, type u32, value); tensor infos as (name,
n_dims u32, dims u64 x n, type u32, offset u64); the data section starts at the next
multiple of ``general.alignment`` (32 by default) after the tensor infos.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types -> struct format (scalars) / numpy dtype (array items)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAGIC = 0x46554747  # b"GGUF" read as little-endian u32


@dataclass(frozen=True)
class LazyArray:
    """A metadata array by position: ``contents()`` decodes it (numbers as a list, strings
    as a list of str); ``len()`` costs nothing."""

    buf: Any
    item_type: int
    count: int
    offset: int           # first item
    string_offsets: tuple[int, ...] | None = None  # for string arrays: each item's start

    def __len__(self) -> int:
        return self.count

    def contents(self) -> list:
        if self.item_type == _STRING:
            out = []
            for off in self.string_offsets or ():
                (n,) = struct.unpack_from("<Q", self.buf, off)
                out.append(bytes(self.buf[off + 8:off + 8 + n]).decode("utf-8"))
            return out
        return np.frombuffer(self.buf, dtype=_NUMPY[self.item_type], count=self.count,
                             offset=self.offset).tolist()


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any      # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (fastest-varying first), like GGUFReader
    data: np.ndarray      # read-only view, shaped like GGUFReader's ``data``


class GGUFFile:
    """``fields``: key -> Python value (scalars, str) or ``LazyArray``; ``tensors``: the
    tensor table in file order."""

    def __init__(self, path: Path):
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != _MAGIC:
            raise ValueError(f"{path.name} is not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise ValueError(f"{path.name}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key], pos = _read_value(buf, pos, vtype)
        infos = []
        for _ in range(n_tensors):
            name, pos = _read_string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, qtype, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-pos // align) * align
        self.tensors = [self._tensor(name, dims, qtype, start + off)
                        for name, dims, qtype, off in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path.name}: duplicated tensor names")

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: int, offset: int
                ) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.constants import GGMLQuantizationType as Q

        kind = Q(qtype)
        n = int(np.prod(dims))
        np_dims = tuple(reversed(dims))
        plain = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
        if kind in plain:
            dtype = np.dtype(plain[kind])
            data = np.frombuffer(self._map, dtype=dtype, count=n, offset=offset)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            if np_dims[-1] % block:
                raise ValueError(f"{name}: row of {np_dims[-1]} is not whole {kind.name} "
                                 f"blocks of {block}")
            np_dims = (*np_dims[:-1], np_dims[-1] // block * size)
            data = np.frombuffer(self._map, dtype=np.uint8, count=n * size // block,
                                 offset=offset)
        return GGUFTensor(name, kind, tuple(int(d) for d in dims), data.reshape(np_dims))

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value (arrays decoded), or ``default``."""
        value = self.fields.get(key, default)
        return value.contents() if isinstance(value, LazyArray) else value


def _read_string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _read_value(buf, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {vtype}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _NUMPY:
        size = np.dtype(_NUMPY[item_type]).itemsize
        return LazyArray(buf, item_type, count, pos), pos + size * count
    if item_type == _STRING:
        offsets = []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            offsets.append(pos)
            pos += 8 + unpack(buf, pos)[0]
        return LazyArray(buf, item_type, count, offsets[0] if offsets else pos,
                         tuple(offsets)), pos
    items = []  # arrays of arrays: rare and small, decoded eagerly
    for _ in range(count):
        value, pos = _read_value(buf, pos, item_type)
        items.append(value.contents() if isinstance(value, LazyArray) else value)
    return items, pos

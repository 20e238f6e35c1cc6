"""Integer weights with float group scales, activations in the model's dtype ("WNA16": GPTQ
and AWQ checkpoints, ``--quantization gptq`` / ``awq``; GGUF blocks, ``gguf``): the layout
a linear layer serves them in, and its torch reference.

Served layout (this rank's shard, after ``process_weights``), ``bits`` 4 or 8, ``pack =
32 // bits`` codes per int32, K the layer's input columns on this rank, N its output rows:
- ``qweight`` int32 ``[K // pack, N]``: code ``q[k, n]`` (unsigned, ``0 .. 2**bits - 1``)
  is bits ``[(k % pack) * bits, (k % pack + 1) * bits)`` of ``qweight[k // pack, n]``
  (packed along K, GPTQ's order);
- ``scales`` ``[G, N]`` and ``zeros`` ``[G, N]``, both in the activation dtype: the scale
  and the zero point (the checkpoint's integer zero as a float: always an integer, below
  ``2**bits + 1``; the fp16 kernel relies on it) of group ``g``;
- ``g_idx`` int32 ``[K]``: the group of input column ``k`` (``0 <= g_idx[k] < G``; with
  GPTQ's act-order any order, else ``k // group_size`` shifted to this rank's groups);
- ``perm`` int32 ``[K]`` or None: served column ``c`` multiplies activation column
  ``perm[c]`` (act-order columns sorted by group, ``sort_columns``).

``W[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``, computed in float32
and rounded once to the activation dtype; ``y = x W^T (+ bias)``. The ``offset`` form
(GGUF's ``Q4_1``, ``Q5_1``, K-quants and modules mixing types, ``Wna16Method.offset``):
``zeros`` are any floats added after the scale, ``W = q * scales + zeros`` (in float32, the
product and the sum each rounded, then the cast; with 16-bit scales the product is exact).
Zero padding (the rows and columns ``parallel/`` pads with) has scale 0 on padding rows (so
``W`` is 0) and code 0 on padding columns, where the input is zero.
"""

from __future__ import annotations

import torch

BITS = (4, 8)
# from this many activation rows a product dequantizes the layer's weight once into a
# [K, N] scratch and multiplies it by cuBLAS (``kernels/triton_wna16.py``): on an H100
# (round 31, a llama3-8b layer's four products, 4-bit) the fused 64 x 128 tiles took 308 us
# at 128 rows and 532 at 256, the dequantized weight 379 and 405
DEQUANT_MIN_M = 160


def pack_factor(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not supported; tpserve serves 4 or 8 bits")
    return 32 // bits


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` ``[K, N]`` (integers in ``0 .. 2**bits - 1``, K a multiple of the pack
    factor) -> int32 ``[K // pack, N]`` in the served layout."""
    pack = pack_factor(bits)
    k, n = codes.shape
    if k % pack:
        raise ValueError(f"{k} input columns do not pack by {pack}")
    c = codes.reshape(k // pack, pack, n)
    packed = torch.zeros((k // pack, n), dtype=torch.int64, device=codes.device)
    for j in range(pack):  # one field at a time: a byte of temporaries per code
        packed |= c[:, j].to(torch.int64) << (j * bits)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, dim: int = 0,
           order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``packed`` along ``dim`` (2-d) -> its int32 codes, ``dim`` ``pack`` times
    longer: bit field ``j`` of each int32 holds position ``order[j]`` of its pack (default:
    position ``j``, the served layout's and GPTQ's order; AWQ interleaves). The inverse of
    ``pack_rows`` for ``dim`` 0."""
    pack = pack_factor(bits)
    fields = order or tuple(range(pack))
    shifts = torch.tensor([fields.index(i) * bits for i in range(pack)], dtype=torch.int32,
                          device=packed.device)
    view = [1, 1, 1]
    view[dim + 1] = pack
    codes = (packed.unsqueeze(dim + 1) >> shifts.view(view)) & (2**bits - 1)
    shape = list(packed.shape)
    shape[dim] *= pack
    return codes.reshape(shape)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor, bits: int,
               runs: tuple[int, int] | None = None, offset: bool = False) -> torch.Tensor:
    """``W [N, K]`` in ``scales``' dtype (the torch reference of every WNA16 product):
    ``(q - z) * s`` in float32, or with ``offset`` (float offsets, GGUF's ``Q4_1`` ...)
    ``q * s + z``, rounded once. ``runs`` ``(first, size)``: ``g_idx`` is known to be
    ``first + k // size`` (groups in column order, ``consecutive_groups``), so each group's
    rows are scaled as one block (when ``size`` divides K) instead of gathering a scale and
    a zero point per element: the same values."""
    q = unpack(qweight, bits).float()
    k, n = q.shape
    if runs is not None and k % runs[1] == 0:
        first, size = runs
        z = zeros[first:first + k // size].float().unsqueeze(1)
        s = scales[first:first + k // size].float().unsqueeze(1)
        w = q.view(k // size, size, n)
    else:
        g = g_idx.long()
        z, s, w = zeros.float().index_select(0, g), scales.float().index_select(0, g), q
    w = w.mul_(s).add_(z) if offset else w.sub_(z).mul_(s)
    return w.reshape(k, n).t().to(scales.dtype)


def consecutive_groups(g_idx: torch.Tensor, groups: int) -> tuple[int, int] | None:
    """``(first, size)`` when ``g_idx == first + arange(K) // size`` (no act-order: this
    rank's columns in groups of ``size`` from its first, the last one possibly shorter, or
    all in one), else None; read once, when the weights are processed (the kernels' and
    ``dequantize``'s ``runs``)."""
    k = g_idx.numel()
    first = int(g_idx[0])
    size = int((g_idx == first).sum())  # the first group's columns: every group's, if any
    if first + (k - 1) // size >= groups:
        return None
    want = first + torch.arange(k, device=g_idx.device) // size
    return (first, size) if torch.equal(g_idx.long(), want) else None


def sort_columns(qweight: torch.Tensor, g_idx: torch.Tensor, bits: int, groups: int,
                 chunk: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor,
                                                torch.Tensor | None, tuple[int, int] | None]:
    """``(qweight, g_idx, perm, runs)`` to serve: groups already in column order are
    returned as they are (``perm`` None, ``runs`` their ``consecutive_groups``). Groups in
    any order (GPTQ's act-order) whose columns, sorted by group, fall into runs of one size
    (every group whole on this rank: tp 1, or a column-parallel layer) are served sorted:
    served column ``c`` is the checkpoint's column ``perm[c]`` (its codes moved there, its
    activation read from there), so the kernels read one scale row per group instead of one
    per column. Otherwise (a row-parallel rank holding parts of groups) nothing changes
    (``runs`` None). The codes are unpacked ``chunk`` codes at a time."""
    runs = consecutive_groups(g_idx, groups)
    if runs is not None:
        return qweight, g_idx, None, runs
    order = torch.argsort(g_idx, stable=True)
    runs = consecutive_groups(g_idx[order], groups)
    if runs is None:
        return qweight, g_idx, None, None
    k, n = qweight.shape[0] * pack_factor(bits), qweight.shape[1]
    step = max(1, chunk // k)
    out = torch.empty_like(qweight)
    for c in range(0, n, step):
        out[:, c:c + step] = pack_rows(unpack(qweight[:, c:c + step], bits)[order], bits)
    return out, g_idx[order].to(torch.int32), order.to(torch.int32), runs


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
           runs: tuple[int, int] | None = None, perm: torch.Tensor | None = None,
           offset: bool = False) -> torch.Tensor:
    """``x W^T (+ bias)`` through the dequantized weight (the torch ops' path; ``offset``
    as in ``dequantize``); served column ``c`` multiplies activation column ``perm[c]``
    (``sort_columns``)."""
    w = dequantize(qweight, scales, zeros, g_idx, bits, runs, offset)
    if perm is not None:
        x = x.index_select(-1, perm.long())
    return torch.nn.functional.linear(x, w, bias)

"""FP8 linear layers sharded over 2 gloo ranks against the tp-1 fp8 layers (torch
reference method), in both paths: weight-only (M=3) and W8A8 (M=6, activations quantized
per token). Shapes that tp does not divide (23 MLP columns, 9 query / 3 KV heads) put
zero-padded rows and columns on the last rank.

Exact: every rank's fp8 codes and scales are the tp-1 ones of its shard (padding: zero
codes, the minimum scale), and padded outputs are exactly zero. Within float32 summation
order: column-parallel outputs at either M, row-parallel weight-only outputs; row-parallel
W8A8 equals the sum over shards of the tp-1 reference applied to each input shard (its
activations are scaled per token over each rank's columns)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.model.quant.fp8 import FP8, MIN_SCALE, Fp8LinearMethod, reference_w8a8
from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.parallel.shard import ShardMap
from tpserve.parallel.state import TPGroup

HID, OUT, ODD, HEADS, KV_HEADS, HEAD_DIM = 16, 24, 23, 9, 3, 4
METHOD = Fp8LinearMethod("torch", weight_only_max_tokens=4)
SMALL_M, LARGE_M = 3, 6


def _sources(shard: ShardMap) -> list[int | None]:
    """The checkpoint row (or column) of each local one; None for padding."""
    src: list[int | None] = [None] * (shard.size * shard.unit)
    for local, first, n in shard.runs:
        for i in range(n * shard.unit):
            src[local * shard.unit + i] = first * shard.unit + i
    return src


def _expand(full: torch.Tensor, sources: list[int | None], dim: int) -> torch.Tensor:
    """``full`` indexed by ``sources`` along ``dim``, zeros where None."""
    idx = torch.tensor([0 if s is None else s for s in sources])
    out = full.index_select(dim, idx)
    pad = torch.tensor([s is None for s in sources])
    return out.masked_fill(pad.view([-1 if d == dim else 1 for d in range(full.dim())]), 0)


def _load(layer, parts, bias_parts=()) -> None:
    for sid, w in parts:
        layer.weight.weight_loader(layer.weight, w, sid)
    for sid, b in bias_parts:
        layer.bias.weight_loader(layer.bias, b, sid)
    layer.process_weights_after_loading()


def _check(group: TPGroup) -> dict[str, float]:
    comm = Communicator(group)
    one = Communicator(TPGroup(0, 1, torch.device("cpu"), None))
    tp, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(7)
    xs = {m: torch.randn(m, HID, generator=g) for m in (SMALL_M, LARGE_M)}
    err: dict[str, float] = {}

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        assert torch.isfinite(got).all(), name
        err[name] = ((got - want).abs().max() / want.abs().max()).item()

    def same_codes(name: str, layer, ref, rows: list[int | None], cols=None) -> None:
        """The rank's codes and scales are the tp-1 layer's, at its rows (and columns)."""
        assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
        want = _expand(ref.weight.view(torch.uint8), rows, 0)
        want_s = _expand(ref.weight_scale, rows, 0)
        pad = torch.tensor([s is None for s in rows])
        want_s[pad] = MIN_SCALE
        if cols is not None:
            want = _expand(want, cols, 1)
        assert torch.equal(layer.weight.view(torch.uint8), want), name
        assert torch.equal(layer.weight_scale, want_s), name

    # column parallel, gathered
    w, b = torch.randn(OUT, HID, generator=g), torch.randn(OUT, generator=g)
    col = ColumnParallelLinear(HID, OUT, comm, bias=True, gather_output=True,
                               quant_method=METHOD)
    ref = ColumnParallelLinear(HID, OUT, one, bias=True, quant_method=METHOD)
    _load(col, [(None, w)], [(None, b)])
    _load(ref, [(None, w)], [(None, b)])
    per = OUT // tp
    same_codes("column", col, ref, list(range(r * per, (r + 1) * per)))
    for m, x in xs.items():
        close(f"column_m{m}", col(x), ref(x))

    # merged gate/up, 23 rows each: the last rank holds a padding row of each part
    wg, wu = torch.randn(ODD, HID, generator=g), torch.randn(ODD, HID, generator=g)
    mlp = MergedColumnParallelLinear(HID, [ODD, ODD], comm, quant_method=METHOD)
    mref = MergedColumnParallelLinear(HID, [ODD, ODD], one, quant_method=METHOD)
    _load(mlp, [(0, wg), (1, wu)])
    _load(mref, [(0, wg), (1, wu)])
    rows = [s for i, p in enumerate(mlp.parts)
            for s in [None if s is None else s + i * ODD for s in _sources(p)]]
    same_codes("merged", mlp, mref, rows)
    for m, x in xs.items():
        got, want = mlp(x), _expand(mref(x), rows, 1)
        close(f"merged_m{m}", got, want)
        pad = [i for i, s in enumerate(rows) if s is None]
        assert torch.equal(got[:, pad], torch.zeros(m, len(pad)))

    # QKV, 9 query / 3 KV heads: zero-padded heads at tp 2
    wts = {"q": torch.randn(HEADS * HEAD_DIM, HID, generator=g),
           "k": torch.randn(KV_HEADS * HEAD_DIM, HID, generator=g),
           "v": torch.randn(KV_HEADS * HEAD_DIM, HID, generator=g)}
    qkv = QKVParallelLinear(HID, HEAD_DIM, HEADS, KV_HEADS, comm, quant_method=METHOD)
    qref = QKVParallelLinear(HID, HEAD_DIM, HEADS, KV_HEADS, one, quant_method=METHOD)
    _load(qkv, list(wts.items()))
    _load(qref, list(wts.items()))
    base = {"q": 0, "k": HEADS * HEAD_DIM, "v": (HEADS + KV_HEADS) * HEAD_DIM}
    rows = [None if s is None else s + base[sid]
            for sid in ("q", "k", "v") for s in _sources(qkv.maps[sid][1])]
    same_codes("qkv", qkv, qref, rows)
    for m, x in xs.items():
        got = qkv(x)
        close(f"qkv_m{m}", got, _expand(qref(x), rows, 1))
        pad = [i for i, s in enumerate(rows) if s is None]
        assert torch.equal(got[:, pad], torch.zeros(m, len(pad)))

    # row parallel over 23 input columns (the last rank's last column is padding), bias
    wr, br = torch.randn(HID, ODD, generator=g), torch.randn(HID, generator=g)
    in_map = ShardMap.contiguous(ODD, tp, r)
    row = RowParallelLinear(ODD, HID, comm, bias=True, in_map=in_map, quant_method=METHOD)
    rref = RowParallelLinear(ODD, HID, one, bias=True, in_map=ShardMap.contiguous(ODD, 1, 0),
                             quant_method=METHOD)
    row.weight.weight_loader(row.weight, wr)
    row.bias.weight_loader(row.bias, br)
    row.process_weights_after_loading()
    rref.weight.weight_loader(rref.weight, wr)
    rref.bias.weight_loader(rref.bias, br)
    rref.process_weights_after_loading()
    cols = _sources(in_map)
    ref_codes = rref.weight.view(torch.uint8)
    assert torch.equal(row.weight.view(torch.uint8), _expand(ref_codes, cols, 1))
    assert torch.equal(row.weight_scale, rref.weight_scale)  # the whole row's amax
    for m in (SMALL_M, LARGE_M):
        x = torch.randn(m, ODD, generator=g)
        got = row(_expand(x, cols, 1))
        if m <= METHOD.weight_only_max_tokens:
            want = rref(x)
        else:  # each rank's activation shard quantized per token on its own
            want = br.clone().expand(m, HID)
            for j in range(tp):
                sj = _sources(ShardMap.contiguous(ODD, tp, j))
                want = want + reference_w8a8(_expand(x, sj, 1),
                                             _expand(ref_codes, sj, 1).view(FP8),
                                             rref.weight_scale, None)
            # and still close to the tp-1 fp8 layer (both within fp8 error)
            assert (got - rref(x)).abs().max() <= 0.05 * rref(x).abs().max()
        close(f"row_m{m}", got, want)
    return err


def test_fp8_layers_at_tp2_equal_the_tp1_fp8_layers():
    results = run_ranks(_check, 2, timeout_s=240)
    for rank, errs in enumerate(results):
        assert len(errs) == 8
        for name, e in errs.items():
            assert e < 1e-6, f"rank {rank} {name}: relative error {e}"


def test_a_zero_weight_shard_gives_zero_codes_and_finite_outputs():
    one = Communicator(TPGroup(0, 1, torch.device("cpu"), None))
    layer = ColumnParallelLinear(8, 4, one, quant_method=METHOD)
    _load(layer, [(None, torch.zeros(4, 8))])
    assert torch.equal(layer.weight.view(torch.uint8), torch.zeros(4, 8, dtype=torch.uint8))
    assert torch.equal(layer.weight_scale, torch.full((4,), MIN_SCALE))
    for m in (SMALL_M, LARGE_M):
        assert torch.equal(layer(torch.randn(m, 8)), torch.zeros(m, 4))
        assert torch.equal(layer(torch.zeros(m, 8)), torch.zeros(m, 4))


def test_unquantized_layers_keep_f_linear():
    one = Communicator(TPGroup(0, 1, torch.device("cpu"), None))
    layer = ColumnParallelLinear(8, 4, one)
    w = torch.randn(4, 8)
    _load(layer, [(None, w)])
    x = torch.randn(3, 8)
    assert layer.weight.dtype == torch.float32 and torch.equal(layer(x), F.linear(x, w))

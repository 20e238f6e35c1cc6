"""Each tensor-parallel layer, sharded over 2 and 3 gloo ranks, equals the unsharded layer;
zero-padded heads and MLP columns (9 query / 3 KV heads at tp 2 and 4) leave the attention
block and the MLP unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpserve.parallel.comm import Communicator
from tpserve.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.parallel.shard import InMemorySource, ShardMap
from tpserve.parallel.state import TPGroup

HID, OUT, HEADS, HEAD_DIM, VOCAB = 12, 24, 6, 4, 50


def _errors(group: TPGroup) -> dict[str, float]:
    """Runs on every rank with identical random weights; returns max abs errors."""
    comm = Communicator(group)
    tp, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(5, HID, generator=g)
    err: dict[str, float] = {}

    w, b = torch.randn(OUT, HID, generator=g), torch.randn(OUT, generator=g)
    col = ColumnParallelLinear(HID, OUT, comm, bias=True, gather_output=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert col.weight.shape == (OUT // tp, HID)  # a shard, never the full weight
    err["column_gathered"] = (col(x) - F.linear(x, w, b)).abs().max().item()

    col.gather_output = False
    shard = slice(r * OUT // tp, (r + 1) * OUT // tp)
    err["column_shard"] = (col(x) - F.linear(x, w, b)[:, shard]).abs().max().item()

    wr, br = torch.randn(HID, OUT, generator=g), torch.randn(HID, generator=g)
    row = RowParallelLinear(OUT, HID, comm, bias=True)
    row.weight.weight_loader(row.weight, wr)
    row.bias.weight_loader(row.bias, br)
    assert row.weight.shape == (HID, OUT // tp)
    xr = torch.randn(5, OUT, generator=g)
    err["row"] = (row(xr[:, shard]) - F.linear(xr, wr, br)).abs().max().item()

    wg, wu = torch.randn(OUT, HID, generator=g), torch.randn(OUT, HID, generator=g)
    mlp = MergedColumnParallelLinear(HID, [OUT, OUT], comm)
    mlp.weight.weight_loader(mlp.weight, wg, 0)
    mlp.weight.weight_loader(mlp.weight, wu, 1)
    expect = torch.cat([F.linear(x, wg)[:, shard], F.linear(x, wu)[:, shard]], -1)
    err["merged_gate_up"] = (mlp(x) - expect).abs().max().item()

    for kv_heads in (1, tp):  # replicated KV heads, then split KV heads
        wq = torch.randn(HEADS * HEAD_DIM, HID, generator=g)
        wk = torch.randn(kv_heads * HEAD_DIM, HID, generator=g)
        wv = torch.randn(kv_heads * HEAD_DIM, HID, generator=g)
        bq = torch.randn(HEADS * HEAD_DIM, generator=g)
        bk = torch.randn(kv_heads * HEAD_DIM, generator=g)
        bv = torch.randn(kv_heads * HEAD_DIM, generator=g)
        qkv = QKVParallelLinear(HID, HEAD_DIM, HEADS, kv_heads, comm, bias=True)
        for sid, wt, bt in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.weight.weight_loader(qkv.weight, wt, sid)
            qkv.bias.weight_loader(qkv.bias, bt, sid)
        q, k, v = qkv.split(qkv(x))
        qf = F.linear(x, wq, bq).view(5, HEADS, HEAD_DIM)
        kf = F.linear(x, wk, bk).view(5, kv_heads, HEAD_DIM)
        vf = F.linear(x, wv, bv).view(5, kv_heads, HEAD_DIM)
        hq = HEADS // tp
        kv0 = r // (tp // kv_heads) if kv_heads < tp else r * (kv_heads // tp)
        nkv = k.shape[1]
        err[f"qkv_kv{kv_heads}"] = max(
            (q - qf[:, r * hq:(r + 1) * hq]).abs().max().item(),
            (k - kf[:, kv0:kv0 + nkv]).abs().max().item(),
            (v - vf[:, kv0:kv0 + nkv]).abs().max().item())
        # every query head of this rank still sees the KV head it belongs to
        group_size = HEADS // kv_heads
        assert all((r * hq + h) // group_size in range(kv0, kv0 + nkv) for h in range(hq))

    emb_w = torch.randn(VOCAB, HID, generator=g)
    ids = torch.tensor([0, 1, 16, 17, 33, 34, 49, 25])
    emb = VocabParallelEmbedding(VOCAB, HID, comm)
    emb.weight.weight_loader(emb.weight, emb_w)
    err["embedding"] = (emb(ids) - F.embedding(ids, emb_w)).abs().max().item()

    # sequence parallel: the same layers ending in a reduce-scatter over tokens
    rows = slice(r * 6 // tp, (r + 1) * 6 // tp)  # 6 tokens: divisible by 2 and 3
    x6 = torch.randn(6, OUT, generator=g)
    row_rs = RowParallelLinear(OUT, HID, comm, bias=True, reduce="reduce_scatter")
    row_rs.weight.weight_loader(row_rs.weight, wr)
    row_rs.bias.weight_loader(row_rs.bias, br)
    err["row_reduce_scatter"] = (row_rs(x6[:, shard]) - F.linear(x6, wr, br)[rows]
                                 ).abs().max().item()
    emb_rs = VocabParallelEmbedding(VOCAB, HID, comm, reduce="reduce_scatter")
    emb_rs.weight.weight_loader(emb_rs.weight, emb_w)
    err["embedding_reduce_scatter"] = (emb_rs(ids[:6]) - F.embedding(ids[:6], emb_w)[rows]
                                       ).abs().max().item()
    mine = torch.full((2, 3), float(r + 1))
    gathered = comm.all_gather(mine, dim=0)
    assert gathered.shape == (2 * tp, 3)
    assert gathered[:, 0].tolist() == [float(i // 2 + 1) for i in range(2 * tp)]
    summed = comm.reduce_scatter(torch.arange(6.0 * tp).view(2 * tp, 3) * (r + 1))
    want = torch.arange(6.0 * tp).view(2 * tp, 3)[2 * r:2 * r + 2] * (tp * (tp + 1) / 2)
    err["reduce_scatter"] = (summed - want).abs().max().item()

    head = ParallelLMHead(VOCAB, HID, comm)
    head.weight.weight_loader(head.weight, emb_w)
    logits = head(x)
    assert logits.shape == (5, VOCAB)
    err["lm_head"] = (logits - F.linear(x, emb_w)).abs().max().item()
    return err


@pytest.mark.parametrize("tp", [2, 3])
def test_parallel_layers_equal_unsharded(tp):
    results = run_ranks(_errors, tp, timeout_s=180)
    assert len(results) == tp
    for rank, errs in enumerate(results):
        assert set(errs) == {"column_gathered", "column_shard", "row", "merged_gate_up",
                             "qkv_kv1", f"qkv_kv{tp}", "embedding", "lm_head",
                             "row_reduce_scatter", "embedding_reduce_scatter",
                             "reduce_scatter"}
        for name, e in errs.items():
            assert e < 1e-5, f"rank {rank} {name}: max error {e}"


def test_single_rank_layers_do_no_communication():
    comm = Communicator(TPGroup(0, 1, torch.device("cpu"), None))
    x = torch.ones(3, 4)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x) is x
    assert comm.broadcast(x) is x
    assert comm.reduce_scatter(x) is x
    assert comm.all_gather(x, dim=0) is x


def test_split_that_does_not_divide_is_a_clear_error():
    class Two:
        rank, world_size = 0, 2

    with pytest.raises(ValueError, match=r"output features \(5\) is not divisible .* \(2\)"):
        ColumnParallelLinear(4, 5, Two())


PQ, PKV, PD, PHID, PINTER = 9, 3, 4, 12, 9  # SmolLM2's head counts; a width 2 and 4 pad


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) GQA attention: query head h uses KV head h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = torch.einsum("thd,shd->hts", q, k).mul(PD ** -0.5).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def _padded_errors(group: TPGroup) -> dict[str, float]:
    comm = Communicator(group)
    r = comm.rank
    g = torch.Generator().manual_seed(99)
    x = torch.randn(7, PHID, generator=g)
    wq, wk, wv = (torch.randn(n * PD, PHID, generator=g) for n in (PQ, PKV, PKV))
    bq, bk, bv = (torch.randn(n * PD, generator=g) for n in (PQ, PKV, PKV))
    wo = torch.randn(PHID, PQ * PD, generator=g)
    qkv = QKVParallelLinear(PHID, PD, PQ, PKV, comm, bias=True)
    o_proj = RowParallelLinear(PQ * PD, PHID, comm, in_map=qkv.layout.q_map(r, PD))
    for sid, wt, bt in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        qkv.weight.weight_loader(qkv.weight, wt, sid)
        qkv.bias.weight_loader(qkv.bias, bt, sid)
    o_proj.weight.weight_loader(o_proj.weight, wo)
    q, k, v = qkv.split(qkv(x))
    # each local head is its checkpoint head, or exactly zero when it is padding
    qf = F.linear(x, wq, bq).view(7, PQ, PD)
    kf, vf = F.linear(x, wk, bk).view(7, PKV, PD), F.linear(x, wv, bv).view(7, PKV, PD)
    head_err = 0.0
    for got, full, sources in ((q, qf, qkv.layout.q_sources(r)),
                               (k, kf, qkv.layout.kv_sources(r)),
                               (v, vf, qkv.layout.kv_sources(r))):
        for i, src in enumerate(sources):
            want = torch.zeros(7, PD) if src is None else full[:, src]
            head_err = max(head_err, (got[:, i] - want).abs().max().item())
    out = o_proj(_attend(q, k, v).flatten(1))
    ref = F.linear(_attend(qf, kf, vf).flatten(1), wo)

    wg, wu = torch.randn(PINTER, PHID, generator=g), torch.randn(PINTER, PHID, generator=g)
    wd = torch.randn(PHID, PINTER, generator=g)
    gate_up = MergedColumnParallelLinear(PHID, [PINTER, PINTER], comm)
    down = RowParallelLinear(PINTER, PHID, comm,
                             in_map=ShardMap.contiguous(PINTER, comm.world_size, r))
    gate_up.weight.weight_loader(gate_up.weight, wg, 0)
    gate_up.weight.weight_loader(gate_up.weight, wu, 1)
    down.weight.weight_loader(down.weight, wd)
    h = gate_up(x)
    half = h.shape[-1] // 2
    mlp = down(F.silu(h[:, :half]) * h[:, half:])
    mlp_ref = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    return {"shapes": (q.shape[1], k.shape[1], half, qkv.layout.padded_heads,
                       qkv.layout.padded_kv_heads),
            "heads": head_err, "attention": (out - ref).abs().max().item(),
            "mlp": (mlp - mlp_ref).abs().max().item()}


@pytest.mark.parametrize("tp,shapes", [
    (2, (6, 2, 5, 12, 4)),  # 9 -> 12 q heads, 3 -> 4 KV heads, 9 -> 10 MLP columns
    (4, (3, 1, 3, 12, 4)),  # 9 -> 12 q heads, 3 -> 4 KV heads, 9 -> 12 MLP columns
])
def test_zero_padded_heads_and_mlp_equal_unsharded(tp, shapes):
    results = run_ranks(_padded_errors, tp, timeout_s=180)
    for rank, res in enumerate(results):
        assert res["shapes"] == shapes
        for name in ("heads", "attention", "mlp"):
            assert res[name] < 1e-4, f"rank {rank} {name}: max error {res[name]}"


def test_shard_map_runs_read_only_real_units():
    m = ShardMap.from_sources([4, 5, None, 7, 8, None], unit=2)
    assert (m.size, m.numel, m.runs, m.padded) == (6, 12, ((0, 4, 2), (3, 7, 2)), True)
    assert ShardMap.contiguous(9, 4, 3).runs == ()  # all padding
    assert ShardMap.contiguous(9, 4, 2).runs == ((0, 6, 3),)
    assert ShardMap.contiguous(10, 4, 3).runs == ((0, 9, 1),)
    dest = torch.full((12, 1), 7.0)
    m.load(dest, InMemorySource(torch.arange(20.0).view(20, 1)), 0, "t")
    assert dest[:, 0].tolist() == [8, 9, 10, 11, 0, 0, 14, 15, 16, 17, 0, 0]

"""Each tensor-parallel layer, sharded over 2 and 3 gloo ranks, equals the unsharded layer."""

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
                             "qkv_kv1", f"qkv_kv{tp}", "embedding", "lm_head"}
        for name, e in errs.items():
            assert e < 1e-5, f"rank {rank} {name}: max error {e}"


def test_single_rank_layers_do_no_communication():
    comm = Communicator(TPGroup(0, 1, torch.device("cpu"), None))
    x = torch.ones(3, 4)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x) is x
    assert comm.broadcast(x) is x


def test_split_that_does_not_divide_is_a_clear_error():
    class Two:
        rank, world_size = 0, 2

    with pytest.raises(ValueError, match=r"output features \(5\) is not divisible .* \(2\)"):
        ColumnParallelLinear(4, 5, Two())
    with pytest.raises(ValueError, match=r"number of attention heads \(3\)"):
        QKVParallelLinear(12, 4, 3, 1, Two())

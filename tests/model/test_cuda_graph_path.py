"""The padded static-buffer decode path that CUDA graphs replay gives the logits of the
plain forward (run eagerly here on CPU; on CUDA the same path is captured)."""

from __future__ import annotations

import torch

from tests.model.test_tiny_models import _hf_model
from tests.model.util import load, new_pool, run, save_hf_folder
from tpserve.model.cuda_graphs import DecodeGraphs, buckets_for
from tpserve.model.plan import SeqChunk, StepPlan


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets_for(40) == [1, 2, 4, 8, 16, 32, 40]


def test_padded_decode_equals_plain_forward(tmp_path):
    model, comm = load(str(save_hf_folder(_hf_model("llama"), tmp_path / "m")))
    pool = new_pool(model, comm, num_blocks=32, block_size=4)
    seqs = [[5, 9, 13, 200, 31, 77, 2], [7, 7, 100], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    tables = [[3, 17, 4], [9], [21, 0, 30]]
    run(model, pool, [SeqChunk(s, 0, t, True) for s, t in zip(seqs, tables, strict=True)])
    graphs = DecodeGraphs(model, pool, max_num_seqs=8, max_blocks_per_seq=16,
                          max_model_len=64, device=torch.device("cpu"))
    step = [SeqChunk([42 + i], len(s), t + [31 - i], True)
            for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
    plan = StepPlan.build(step, 4)
    assert graphs.can_run(plan) and graphs.bucket(3) == 4
    before = pool.buffer.clone()
    got = graphs.run(plan)
    written = pool.buffer.clone()
    # the same step through the plain path, on the same cache contents
    pool.buffer.copy_(before)
    want = run(model, pool, step)
    assert got.shape == want.shape == (3, 256)
    assert (got - want).abs().max().item() < 1e-5
    torch.testing.assert_close(written, pool.buffer)  # padding rows wrote nothing
    mixed = StepPlan.build([step[0], SeqChunk([1, 2], 0, [5], True)], 4)
    assert not graphs.can_run(mixed)  # prefills never take the graph path

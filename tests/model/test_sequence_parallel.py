"""``--tp-comm``: both tensor-parallel communication modes (all-reduce, and sequence-parallel
all-gather / reduce-scatter) give tp 1's logits at tp 2, 3 and 4 on gloo, in fp32, over
steps whose token count is not a multiple of tp (the dummy padding tokens must not write
the KV cache), a mixed prefill+decode step and a single-token decode."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_tiny_models import _hf_model
from tests.model.util import load, new_pool, run, save_hf_folder
from tpserve.model.plan import SeqChunk
from tpserve.parallel.launch import run_ranks

A, B, C = [5, 9, 13, 200, 31, 77, 2], [7, 7, 100, 4, 8, 15], [3, 1, 4, 1, 5]
STEPS = [
    # 13 tokens: two prefills
    [SeqChunk(A, 0, [0, 1], True), SeqChunk(B, 0, [2, 3], True)],
    # 7 tokens: two decodes, then a fresh prefill
    [SeqChunk([42], 7, [0, 1], True), SeqChunk([43], 6, [2, 3], True),
     SeqChunk(C, 0, [4, 5], True)],
    # a decode-only batch of 1 token
    [SeqChunk([44], 8, [0, 1, 2], True)],
]


def _steps(model, comm) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every step's logits of all new tokens, and the KV pool it leaves."""
    pool = new_pool(model, comm, num_blocks=8, block_size=4)
    pool.buffer.zero_()
    return [run(model, pool, chunks, all_logits=True) for chunks in STEPS], pool.buffer


def _both_modes(group, folder):
    out = {}
    for mode in ("allreduce", "allgather"):
        model, comm = load(folder, group, tp_comm=mode)
        assert model.sequence_parallel == (mode == "allgather")
        # the residual stream is sharded by tokens in allgather mode: 2 rows of 2*tp here
        rows = model.model.embed_tokens(torch.zeros(2 * comm.world_size, dtype=torch.long))
        assert rows.shape[0] == (2 if mode == "allgather" else 2 * comm.world_size)
        out[mode] = _steps(model, comm)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama (4 query / 2 KV heads: tp 3 pads them) and its tp 1 logits."""
    folder = str(save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("tiny")))
    model, comm = load(folder)
    return folder, _steps(model, comm)[0]


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_both_comm_modes_equal_tp1(tiny, tp):
    folder, want = tiny
    assert [w.shape[0] for w in want] == [13, 7, 1]  # tp 2, 3, 4 divide none of them
    for rank, modes in enumerate(run_ranks(_both_modes, tp, folder, timeout_s=300)):
        for mode, (logits, _) in modes.items():
            for i, (got, ref) in enumerate(zip(logits, want, strict=True)):
                assert got.shape == ref.shape, (rank, mode, i)
                err = (got - ref).abs().max().item()
                assert err < 1e-4, f"tp {tp} rank {rank} {mode} step {i}: {err}"
        # the padding tokens wrote nothing: both modes leave the same KV cache
        torch.testing.assert_close(modes["allgather"][1], modes["allreduce"][1],
                                   atol=1e-5, rtol=0)


def test_single_rank_allgather_is_plain(tiny):
    folder, want = tiny
    model, comm = load(folder, tp_comm="allgather")
    assert not model.sequence_parallel  # nothing to shard at tp 1
    for got, ref in zip(_steps(model, comm)[0], want, strict=True):
        assert torch.equal(got, ref)

"""Decoding token by token through the paged KV pool, with block tables that are neither
contiguous nor ordered, gives the logits of one full-sequence forward."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.test_tiny_models import _hf_model
from tests.model.util import full_logits, load, new_pool, run, save_hf_folder
from tpserve.model.attention.torch_backend import TorchAttention
from tpserve.model.plan import SeqChunk, StepPlan

BLOCK = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = save_hf_folder(_hf_model("llama"), tmp_path_factory.mktemp("paged"))
    return load(str(folder))


def test_token_by_token_decode_equals_full_forward(model):
    m, comm = model
    seq_a = [5, 9, 13, 200, 31, 77, 2, 8, 150, 99, 64, 33, 21, 17, 250, 1, 6, 42, 11]
    seq_b = [7, 7, 100, 3, 45, 210, 12, 90, 66, 5, 18]
    ref_a, ref_b = full_logits(m, comm, seq_a), full_logits(m, comm, seq_b)

    pool = new_pool(m, comm, num_blocks=16, block_size=BLOCK)
    ids = list(range(16))
    random.Random(0).shuffle(ids)
    blocks_a, blocks_b = ids[:5], ids[5:8]  # e.g. [12, 3, 15, ...]: scattered
    assert blocks_a != sorted(blocks_a)

    # step 1: prefill a 6-token chunk of A (logits of its last token)
    got_a = {5: run(m, pool, [SeqChunk(seq_a[:6], 0, blocks_a, True)])[0]}
    # step 2: A decodes while B prefills 5 tokens (a mixed batch, decodes first)
    out = run(m, pool, [SeqChunk([seq_a[6]], 6, blocks_a, True),
                        SeqChunk(seq_b[:5], 0, blocks_b, True)])
    got_a[6] = out[0]
    got_b = {4: out[1]}
    # B's next chunk spans a block boundary; A keeps decoding
    out = run(m, pool, [SeqChunk([seq_a[7]], 7, blocks_a, True),
                        SeqChunk(seq_b[5:7], 5, blocks_b, True)])
    got_a[7], got_b[6] = out[0], out[1]
    # then both decode one token per step to the end
    for pos in range(8, len(seq_a)):
        chunks = [SeqChunk([seq_a[pos]], pos, blocks_a, True)]
        bpos = pos - 1
        if bpos < len(seq_b):
            chunks.append(SeqChunk([seq_b[bpos]], bpos, blocks_b, True))
        out = run(m, pool, chunks)
        got_a[pos] = out[0]
        if bpos < len(seq_b):
            got_b[bpos] = out[1]
    assert sorted(got_a) == list(range(5, len(seq_a)))
    assert sorted(got_b) == [4] + list(range(6, len(seq_b)))
    for pos, logits in got_a.items():
        assert (logits - ref_a[pos]).abs().max().item() < 1e-4, pos
    for pos, logits in got_b.items():
        assert (logits - ref_b[pos]).abs().max().item() < 1e-4, pos


def test_plan_round_trips_through_packing():
    chunks = [SeqChunk([4], 9, [3, 1, 7], True),
              SeqChunk([1, 2, 3], 2, [5, 6], False, -1, (2, 3, 5), 4),
              SeqChunk([8, 9], 0, [2], True, -1, (9,), 2)]
    plan = StepPlan.build(chunks, BLOCK, TorchAttention(torch.float32))
    header, payload = plan.pack()
    assert payload.shape[0] == StepPlan.payload_len(header)
    back = StepPlan.unpack(header, payload)
    assert back.num_decodes == 1 and back.max_query_len == 3 and back.max_seq_len == 10
    assert back.slot_mapping.tolist() == [7 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0, 8, 9]
    assert back.positions.tolist() == [9, 2, 3, 4, 0, 1]
    assert back.logits_indices.tolist() == [0, 5]
    assert back.block_tables.tolist() == [[3, 1, 7], [5, 6, 0], [2, 0, 0]]
    assert back.query_start_loc.tolist() == [0, 1, 4, 6]
    assert back.seq_lens.tolist() == [10, 5, 2]
    torch.testing.assert_close(back.input_ids, plan.input_ids)
    # the scored prompt rows, their targets and the most alternatives any chunk asked for
    assert back.prompt_rows.tolist() == [1, 2, 3, 4] and back.prompt_targets.tolist() == [
        2, 3, 5, 9]
    assert back.prompt_top == 4

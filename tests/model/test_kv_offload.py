"""A rank's host tier of the KV cache (``model/kv_offload.HostKV``): blocks copied out of
the pool and back, bit for bit, in every KV dtype, across batches of the staging buffers;
the slot count from ``--kv-offloading-size``."""

from __future__ import annotations

import pytest
import torch

from tpserve.model.kv_offload import STAGING_BYTES, HostKV, host_slots, staging_blocks
from tpserve.model.kv_pool import KVPool, kv_bytes_per_block

CPU = torch.device("cpu")
LAYERS, BLOCKS, BS, HEADS, DIM = 3, 10, 4, 2, 8


def _pool(dtype: torch.dtype) -> KVPool:
    """A pool whose every byte is random (any bit pattern: the copies move bits)."""
    pool = KVPool(LAYERS, BLOCKS, BS, HEADS, DIM, dtype, CPU)
    raw = pool.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0)))
    return pool


def _block(pool: KVPool, b: int) -> torch.Tensor:
    """Block ``b`` of every layer, K and V, as raw bytes."""
    return pool.buffer[:, :, b].contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("batch", [1, 2, 64], ids=["batch1", "batch2", "whole"])
def test_blocks_stored_and_loaded_back_are_bit_for_bit_the_same(dtype, batch):
    pool = _pool(dtype)
    per_block = kv_bytes_per_block(LAYERS, BS, HEADS, DIM, dtype)
    host = HostKV(pool, 6, per_block)
    host.staging_blocks = min(batch, host.staging_blocks)  # copies in batches this big
    before = {b: _block(pool, b) for b in range(BLOCKS)}
    host.store([7, 2, 9, 0, 5], [3, 0, 5, 1, 2])
    pool.buffer.view(torch.uint8).zero_()
    host.load([0, 3, 5], [1, 4, 8], 0)  # block 2's content into 1, 7's into 4, 9's into 8
    for src, dst in ((2, 1), (7, 4), (9, 8)):
        assert torch.equal(_block(pool, dst), before[src]), (src, dst)
    untouched = [b for b in range(BLOCKS) if b not in (1, 4, 8)]
    assert all(not _block(pool, b).any() for b in untouched)


def test_a_store_then_a_load_of_the_same_slot_in_order():
    """The block manager lists a step's stores before its loads; a slot stored and loaded
    in one step hands the stored content on."""
    pool = _pool(torch.float32)
    host = HostKV(pool, 2, kv_bytes_per_block(LAYERS, BS, HEADS, DIM, torch.float32))
    want = _block(pool, 6)
    host.store([3], [1])
    host.store([6], [1])  # the slot's LRU entry evicted and overwritten in the same step
    host.load([1], [0], 0)
    assert torch.equal(_block(pool, 0), want)


def test_slots_from_the_size_split_over_ranks():
    per_block = 8 * 2**10
    assert host_slots(2**20, 1, per_block) == 128
    assert host_slots(2**20, 2, per_block) == 64  # the size is the sum over the ranks
    assert host_slots(per_block - 1, 1, per_block) == 0
    assert staging_blocks(per_block, 10**6) == STAGING_BYTES // 2 // per_block == 4096
    assert staging_blocks(per_block, 100) == 100  # never more than the tier holds
    assert staging_blocks(STAGING_BYTES, 100) == 1  # a block bigger than the staging budget
    assert HostKV.staging_bytes(per_block, 100) == 2 * (2 * 100 * per_block + 8 * 100)
    with pytest.raises(ValueError, match="at least one block"):
        HostKV(_pool(torch.float32), 0, per_block)


def test_off_cuda_loads_are_done_at_once_and_a_join_waits_for_nothing():
    pool = _pool(torch.float32)
    host = HostKV(pool, 4, kv_bytes_per_block(LAYERS, BS, HEADS, DIM, torch.float32))
    assert host.done_batch() == -1  # nothing given yet
    want = _block(pool, 3)
    host.store([3], [2])
    host.load([2], [5], 0)
    assert host.done_batch() == 0
    host.join(0)
    assert torch.equal(_block(pool, 5), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream: GPU only")
def test_on_cuda_loads_run_beside_the_forward_until_joined():
    """Loads go out on the copy stream after what the forward stream was given; a join
    orders the forward stream after them; a store into a slot a load still reads waits
    for it; ``done_batch`` reaches the newest batch once the device is done."""
    cuda = torch.device("cuda")
    dtype = torch.bfloat16
    pool = KVPool(LAYERS, BLOCKS, BS, HEADS, DIM, dtype, cuda)
    pool.buffer.view(torch.uint8).copy_(torch.randint(
        0, 256, pool.buffer.view(torch.uint8).shape, dtype=torch.uint8, device=cuda))
    per_block = kv_bytes_per_block(LAYERS, BS, HEADS, DIM, dtype)
    before = {b: _block(pool, b) for b in range(BLOCKS)}
    host = HostKV(pool, 6, per_block)
    assert all(torch.equal(_block(pool, b), before[b]) for b in range(BLOCKS))  # warm-up
    host.staging_blocks = 2  # several batches of copies per call
    # the tier's first load: the constructor launched every copy kernel once (a kernel's
    # first launch waits for the device, which the sleep would make the host do)
    host.store([1, 2, 3], [0, 1, 2])
    torch.cuda._sleep(50_000_000)  # the forward stream is busy: the loads wait for it
    pool.buffer[:, :, 7].zero_()  # given to the forward stream before the loads
    host.load([0, 1, 2], [7, 8, 9], 0)
    assert host.done_batch() == -1  # behind the sleep
    host.store([5], [1])  # slot 1 is still being read: the store waits for that load
    host.join(0)
    for src, dst in ((1, 7), (2, 8), (3, 9)):
        assert torch.equal(_block(pool, dst), before[src]), (src, dst)
    host.load([1], [6], 1)
    host.join(1)
    assert torch.equal(_block(pool, 6), before[5])  # the store after the first load
    torch.cuda.synchronize()
    assert host.done_batch() == 1

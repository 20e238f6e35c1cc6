"""BlockManager: exact block ids, refcounts, prefix cache hits, collisions, LRU eviction."""

from __future__ import annotations

import hashlib

import pytest

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.block_manager import BlockManager
from tpserve.server.engine.prefix_hash import sha256_block_hash
from tpserve.server.engine.sequence import Sequence

PARAMS = SamplingParams()


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0,
                    prompt_token_ids=list(tokens), params=PARAMS)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' every token of ``seq`` as one step would."""
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def check(bm: BlockManager, *seqs: Sequence) -> None:
    bm.check_integrity(seqs)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def test_fresh_allocation_order_and_reuse_after_free():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = make_seq(0, range(10)), make_seq(1, range(5))
    check(bm)
    assert bm.allocate(a, 10)
    assert a.block_ids == [0, 1, 2]
    check(bm, a)
    assert bm.allocate(b, 5)
    assert b.block_ids == [3, 4]
    check(bm, a, b)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (5, 3, 5 / 8)

    bm.free(a)  # tail first: 2, 1, 0 go back on the free stack; 0 is on top
    assert a.block_ids == []
    check(bm, b)
    c = make_seq(2, range(17))
    assert bm.allocate(c, 17)
    assert c.block_ids == [0, 1, 2, 5, 6]
    check(bm, b, c)
    bm.free(b)
    bm.free(c)
    check(bm)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_allocate_grows_only_what_is_missing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(0, range(4))
    assert bm.allocate(a, 4)
    assert a.block_ids == [0]
    a.num_computed_tokens = 4
    a.append_token(99)
    assert bm.allocate(a, 1)  # token 4 opens block 1
    assert a.block_ids == [0, 1]
    a.num_computed_tokens = 5
    a.append_token(98)
    assert bm.allocate(a, 1)  # token 5 fits in block 1
    assert a.block_ids == [0, 1]
    check(bm, a)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a, b = make_seq(0, range(24)), make_seq(1, range(12))
    assert bm.allocate(a, 24)
    assert a.block_ids == [0, 1, 2, 3, 4, 5]
    assert not bm.allocate(b, 12)  # needs 3, 2 free
    assert b.block_ids == [] and bm.num_free_blocks == 2
    check(bm, a)
    # Growing a sequence that already holds blocks fails just as cleanly.
    a.num_computed_tokens = 24
    assert not bm.allocate(a, 9)
    assert a.block_ids == [0, 1, 2, 3, 4, 5]
    check(bm, a)
    assert bm.allocate(a, 8)
    assert a.block_ids == [0, 1, 2, 3, 4, 5, 6, 7]
    check(bm, a)


def test_fork_shares_full_blocks_with_refcounts():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = make_seq(0, range(10))
    compute_all(bm, parent)
    assert parent.block_ids == [0, 1, 2]
    child = make_seq(1, range(10))
    bm.fork(parent, child, 9)  # 9 tokens -> 2 full blocks
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 8
    assert [bm.refcount(b) for b in range(3)] == [2, 2, 1]
    check(bm, parent, child)
    assert bm.allocate(child, 2)
    assert child.block_ids == [0, 1, 3]
    check(bm, parent, child)

    bm.free(parent)
    assert [bm.refcount(b) for b in range(4)] == [1, 1, 0, 1]
    check(bm, child)
    bm.free(child)
    check(bm)
    assert bm.num_used_blocks == 0


def test_fork_rejects_uncomputed_or_different_prefix():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    parent = make_seq(0, range(10))
    assert bm.allocate(parent, 10)
    parent.num_computed_tokens = 4
    with pytest.raises(AssertionError):
        bm.fork(parent, make_seq(1, range(10)), 8)
    with pytest.raises(AssertionError):
        bm.fork(parent, make_seq(2, [7] * 10), 4)
    check(bm, parent)


def test_prefix_reuse_gives_same_blocks_and_token_count():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prefix = list(range(100, 108))  # two full blocks
    a = make_seq(0, prefix + [1, 2])
    compute_all(bm, a)
    assert a.block_ids == [0, 1, 2]
    check(bm, a)

    b = make_seq(1, prefix + [3, 4, 5])
    blocks, num_tokens = bm.get_computed_blocks(b.all_token_ids)
    assert (blocks, num_tokens) == ([0, 1], 8)
    assert bm.refcount(0) == 1  # lookups take no references
    assert bm.allocate(b, 3, blocks)
    b.num_computed_tokens = 8
    assert b.block_ids == [0, 1, 3]
    assert [bm.refcount(x) for x in range(4)] == [2, 2, 1, 1]
    check(bm, a, b)

    bm.free(a)
    bm.free(b)  # 0 and 1 stay cached but evictable; 2 and 3 were never full
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 16
    check(bm)

    c = make_seq(2, prefix + [9])
    blocks, num_tokens = bm.get_computed_blocks(c.all_token_ids)
    assert (blocks, num_tokens) == ([0, 1], 8)
    assert bm.allocate(c, 1, blocks)
    assert c.block_ids == [0, 1, 3]  # block 3 was freed last, so it is on top
    assert bm.num_cached_free_blocks == 0 and bm.refcount(0) == 1
    check(bm, c)


def test_computed_blocks_never_cover_the_whole_sequence():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_seq(0, range(12))
    compute_all(bm, a)
    check(bm, a)
    assert bm.get_computed_blocks(list(range(12))) == ([0, 1], 8)
    assert bm.get_computed_blocks(list(range(13))) == ([0, 1, 2], 12)
    assert bm.get_computed_blocks(list(range(8))) == ([0], 4)
    assert bm.get_computed_blocks(list(range(4))) == ([], 0)
    assert bm.get_computed_blocks([0, 1, 2, 5, 4]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_blocks_spanning_prompt_and_output_are_cached():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3])
    compute_all(bm, a)
    a.append_token(4)  # the sampled token
    assert bm.allocate(a, 1)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    check(bm, a)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == ([0], 4)


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(0, range(9))
    compute_all(bm, a)
    assert bm.get_computed_blocks(list(range(9))) == ([], 0)
    bm.free(a)
    assert bm.num_cached_free_blocks == 0
    check(bm)


def test_hash_collision_is_caught_by_token_comparison():
    bm = BlockManager(8, 4, enable_prefix_caching=True, hash_fn=lambda parent, tokens, extra: b"42")
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute_all(bm, a)
    # Block 0 owns hash 42; block 1 collides with it and stays unregistered.
    assert bm.is_cached(0) and not bm.is_cached(1)
    check(bm, a)

    assert bm.get_computed_blocks([9, 9, 9, 9, 9]) == ([], 0)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9]) == ([0], 4)
    bm.free(a)
    assert bm.num_cached_free_blocks == 1  # block 1 went back to the free list
    check(bm)


def mod100_hash(parent: bytes, tokens: tuple[int, ...], extra: bytes) -> bytes:
    """A deliberately weak hash: token ids that differ by a multiple of 100 collide, so two
    prefixes that differ only there collide at every level of the chain."""
    return hashlib.sha256(parent + bytes(t % 100 for t in tokens) + extra).digest()


P0, Q0 = [1, 2, 3, 4], [101, 2, 3, 4]  # collide under mod100_hash
T1, T2 = [5, 6, 7, 8], [9, 10, 11, 12]


def test_colliding_prefix_is_never_served_at_any_level():
    bm = BlockManager(16, 4, enable_prefix_caching=True, hash_fn=mod100_hash)
    a = make_seq(0, P0 + T1 + T2 + [13])
    compute_all(bm, a)
    assert a.block_ids == [0, 1, 2, 3] and [bm.is_cached(b) for b in range(4)] == [
        True, True, True, False]
    # Q0's block 0 hashes like P0's: the token comparison refuses it, so nothing deeper.
    for depth in range(1, 4):
        q = Q0 + (T1 + T2)[:4 * (depth - 1)] + [99]
        assert bm.get_computed_blocks(q) == ([], 0)
    b = make_seq(1, Q0 + T1 + T2 + [14])
    compute_all(bm, b)
    assert b.block_ids == [4, 5, 6, 7]
    # b's blocks collide with a's at every level, so none of them is registered.
    assert not any(bm.is_cached(x) for x in b.block_ids)
    check(bm, a, b)
    assert bm.get_computed_blocks(Q0 + T1 + T2 + [15]) == ([], 0)
    assert bm.get_computed_blocks(P0 + T1 + T2 + [15]) == ([0, 1, 2], 12)


def test_colliding_parent_after_eviction_never_revives_the_other_chain():
    """The hole of a one-level key check: P0's entry is evicted while a's deeper blocks stay
    cached, then Q0 (same hash as P0) is cached in its place. A lookup of Q0 + T1 + T2 must
    hit Q0's own block only, never a's T1/T2 blocks, whose K/V were computed after P0."""
    bm = BlockManager(6, 4, enable_prefix_caching=True, hash_fn=mod100_hash)
    e = make_seq(0, P0 + [20])
    compute_all(bm, e)  # block 0 holds P0, cached
    a = make_seq(1, P0 + T1 + T2 + [13])
    assert bm.allocate(a, 13)  # admitted without a hit (as if both were admitted at once)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert a.block_ids == [2, 3, 4, 5]
    # a's block 2 holds P0 again (unregistered); 3 and 4 chain to block 0's entry.
    assert [bm.is_cached(x) for x in a.block_ids] == [False, True, True, False]
    bm.free(e)  # 1 free; evictable: [0]
    bm.free(a)  # 5 and 2 free; evictable: [0, 4, 3]
    check(bm)
    filler = make_seq(2, [30] * 13)
    assert bm.allocate(filler, 13)  # the free blocks 2, 5, 1, then block 0 is evicted
    assert filler.block_ids == [2, 5, 1, 0]
    bm.free(filler)
    assert bm.get_computed_blocks(P0 + T1 + [15]) == ([], 0)  # P0's entry is gone
    b = make_seq(3, Q0 + [21])
    compute_all(bm, b)  # Q0 is cached under P0's old hash
    assert b.block_ids == [2, 5] and bm.is_cached(2)
    check(bm, b)
    for depth in (1, 2, 3):
        q = Q0 + (T1 + T2)[:4 * (depth - 1)] + [99]
        assert bm.get_computed_blocks(q) == ([2], 4), depth  # never a's blocks 3 or 4
    c = make_seq(4, Q0 + T1 + [22])
    blocks, n = bm.get_computed_blocks(c.all_token_ids)
    assert bm.allocate(c, 5, blocks)
    c.num_computed_tokens = 9
    bm.cache_full_blocks(c)
    # c computed its own T1 block; its hash is still taken by a's unreachable block 3, so
    # it stays unregistered (a cost only a colliding hash pays), and a's block is never hit.
    assert c.block_ids == [2, 1, 0] and not bm.is_cached(1) and bm.is_cached(3)
    check(bm, b, c)
    assert bm.get_computed_blocks(Q0 + T1 + [23]) == ([2], 4)


def test_hashes_are_sha256_chained_from_a_random_root():
    h = sha256_block_hash(b"r" * 32, (1, 2, 3, 4))
    assert len(h) == 32 and h != sha256_block_hash(b"s" * 32, (1, 2, 3, 4))
    assert h != sha256_block_hash(b"r" * 32, (1, 2, 3, 4), b"lora-1")
    # Two managers draw different roots: the same prompt hashes differently in each.
    one, two = (BlockManager(4, 4, enable_prefix_caching=True) for _ in range(2))
    for bm in (one, two):
        compute_all(bm, make_seq(0, [1, 2, 3, 4, 5]))
    assert set(one._cache) != set(two._cache)
    assert one.get_computed_blocks([1, 2, 3, 4, 5]) == ([0], 4)


def test_identical_blocks_computed_twice_keep_the_first_mapping():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = make_seq(0, range(9)), make_seq(1, range(9))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # both admitted before either ran
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.cache_full_blocks(s)
    assert [bm.is_cached(x) for x in range(6)] == [True, True, False, False, False, False]
    check(bm, a, b)
    bm.free(b)
    assert bm.num_cached_free_blocks == 0
    assert bm.get_computed_blocks(list(range(9))) == ([0, 1], 8)
    check(bm, a)


def test_lru_eviction_takes_free_blocks_first_then_oldest_tail_first():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a, b = make_seq(0, [1, 2, 3, 4, 5]), make_seq(1, [11, 12, 13, 14, 15])
    compute_all(bm, a)
    compute_all(bm, b)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4, 5])
    bm.free(a)  # 2 -> free list; 1 then 0 -> evictable
    bm.free(b)  # 5 -> free list; 4 then 3 -> evictable
    check(bm)
    assert bm.num_cached_free_blocks == 4

    c = make_seq(2, [21, 22, 23, 24, 25, 26])
    assert bm.allocate(c, 6)
    # Free blocks first (most recently freed on top), then the LRU evictable one:
    # block 1, a's tail, goes before a's head block 0.
    assert c.block_ids == [5, 2, 1]
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == ([0], 2)
    check(bm, c)

    d = make_seq(3, [31, 32])
    assert bm.allocate(d, 2)
    assert d.block_ids == [0]
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)
    assert bm.get_computed_blocks([11, 12, 13, 14, 15]) == ([3, 4], 4)
    check(bm, c, d)


def test_cache_hit_revives_evictable_block_and_refree_makes_it_most_recent():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [5, 6, 7])
    compute_all(bm, a)
    compute_all(bm, b)
    bm.free(a)  # evictable: [0]
    bm.free(b)  # evictable: [0, 2]
    c = make_seq(2, [1, 2, 9])
    blocks, n = bm.get_computed_blocks(c.all_token_ids)
    assert (blocks, n) == ([0], 2)
    assert bm.allocate(c, 1, blocks)
    assert bm.num_cached_free_blocks == 1
    check(bm, c)
    bm.free(c)  # evictable: [2, 0]; block 0 is now the most recently used
    d = make_seq(3, [40, 41, 42, 43, 44, 45, 46])
    assert bm.allocate(d, 7)
    assert d.block_ids == [3, 1, 2, 0]
    check(bm, d)


def test_allocate_with_evictable_hits_counts_them_against_free_space():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    compute_all(bm, a)
    bm.free(a)  # blocks 0, 1 evictable; 2, 3 free
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    blocks, n = bm.get_computed_blocks(b.all_token_ids)
    assert (blocks, n) == ([0, 1], 4)
    assert not bm.allocate(b, 5, blocks)  # needs 3 more, only 2 besides the hits
    assert b.block_ids == [] and bm.num_cached_free_blocks == 2
    check(bm)
    assert bm.allocate(b, 4, blocks)
    assert b.block_ids == [0, 1, 2, 3]
    check(bm, b)


def test_check_integrity_detects_corruption():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3])
    compute_all(bm, a)
    bm._refcount[3] = 1  # a free block that claims a holder
    with pytest.raises(AssertionError, match="free list"):
        bm.check_integrity()
    bm._refcount[3] = 0
    bm.check_integrity([a])
    with pytest.raises(AssertionError, match="mismatch"):
        bm.check_integrity([a, a])
    bm._cache[b"123"] = 0
    with pytest.raises(AssertionError, match="cache maps hash"):
        bm.check_integrity()


def test_no_salt_spells_another_salt_with_an_adapter():
    """``cache_salt`` and the LoRA adapter are one key: a base-model request whose salt is
    ``"tenant|lora:0"`` shares no block with adapter 0's requests salted ``"tenant"``
    (the two parts were once joined as text, the same bytes), and every pair differs."""
    def salted(seq_id: int, **params) -> Sequence:
        return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0,
                        prompt_token_ids=list(range(9)),
                        params=SamplingParams(max_tokens=1, **params))

    bm = BlockManager(16, 4, True)
    adapter = salted(0, cache_salt="tenant", lora_id=0, lora_slot=0)
    assert bm.allocate(adapter, 9)
    adapter.num_computed_tokens = 9
    bm.cache_full_blocks(adapter, adapter.cache_key)
    bm.free(adapter)
    base = salted(1, cache_salt="tenant|lora:0")
    assert bm.get_computed_blocks(base.all_token_ids, base.cache_key)[1] == 0
    again = salted(2, cache_salt="tenant", lora_id=0, lora_slot=0)
    assert bm.get_computed_blocks(again.all_token_ids, again.cache_key)[1] == 8
    keys = [salted(3 + i, **p).cache_key for i, p in enumerate((
        {}, {"cache_salt": "0"}, {"lora_id": 0, "lora_slot": 0},
        {"cache_salt": "0", "lora_id": 0, "lora_slot": 0}, {"cache_salt": "tenant|lora:0"},
        {"cache_salt": "tenant", "lora_id": 0, "lora_slot": 0}))]
    assert keys[0] == b"" and len(set(keys)) == len(keys)

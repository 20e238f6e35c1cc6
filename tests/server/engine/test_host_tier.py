"""The prefix cache's host tier (``--kv-offloading-size``): evicted blocks stored to host
slots, found again, loaded back; the copies a step owes, in the order they must run; loads
that land steps later, joined before any step touches their blocks.

``Memory`` plays the runners (``fake_kv.FakeKV``: the listed copies on block contents, loads
landing when the test says or a step joins them) and "computes" a step's tokens into its
blocks, so the tests check what every block of a sequence holds after hits from either
tier, not just the bookkeeping."""

from __future__ import annotations

import random

import pytest

from tests.server.engine.fake_kv import FakeKV
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.block_manager import BlockManager, HostHit
from tpserve.server.engine.host_tier import HostTier
from tpserve.server.engine.sequence import Sequence

BS = 4


def make_seq(seq_id: int, tokens) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0,
                    prompt_token_ids=list(tokens), params=SamplingParams())


class Memory(FakeKV):
    """``FakeKV`` with a step that computes a sequence's tokens into its blocks."""

    def compute(self, seq: Sequence) -> None:
        """A step writes ``seq``'s tokens past its hits into its blocks."""
        for pos in range(seq.num_computed_tokens, seq.num_tokens):
            block, offset = self.at(seq, pos)
            block[offset] = seq.all_token_ids[pos]
        seq.num_computed_tokens = seq.num_tokens
        self.bm.cache_full_blocks(seq)

    def admit_and_compute(self, seq: Sequence) -> tuple[int, list, list]:
        """Admits ``seq`` with its prefix hits, runs the copies of a step computing it,
        computes the rest of its tokens; returns (tokens hit, stores, loads)."""
        computed, hit = self.bm.get_computed_blocks(seq.all_token_ids)
        assert self.bm.allocate(seq, seq.num_tokens - hit, computed)
        seq.num_computed_tokens = hit
        copies = self.run_copies([seq])
        self.expect(seq, hit)  # the hits hold the prompt's tokens before the forward
        self.compute(seq)
        self.bm.check_integrity()
        return hit, copies.stores, copies.loads

    def expect(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            block, offset = self.at(seq, pos)
            got = block[offset]
            assert got == seq.all_token_ids[pos], (
                f"seq {seq.seq_id} position {pos}: block {seq.block_ids[pos // BS]} holds "
                f"{got}, expected {seq.all_token_ids[pos]}")


def test_an_evicted_block_is_stored_then_loaded_back_instead_of_computed():
    bm = BlockManager(4, BS, True, host_slots=8)
    mem = Memory(bm)
    a = make_seq(0, range(100, 109))  # 2 full blocks + 1 token
    assert mem.admit_and_compute(a) == (0, [], [])
    bm.free(a)  # blocks 2, 1, 0 (tail first): 1 and 0 are cached, evictable
    b = make_seq(1, range(200, 216))  # 4 blocks: takes the free one and evicts both
    hit, stores, loads = mem.admit_and_compute(b)
    # free blocks first (2, 3), then the evictable ones, least recently freed first: a's
    # block 1 (its tail) then 0; each copied to a host slot before b writes over it
    assert (hit, stores, loads) == (0, [(1, 0), (0, 1)], [])
    assert bm.counters == {"kv_offload_stored_blocks_total": 2,
                           "kv_offload_loaded_blocks_total": 0}
    bm.free(b)
    a2 = make_seq(2, list(range(100, 109)) + [7, 7])
    computed, hit = bm.get_computed_blocks(a2.all_token_ids)
    assert (computed, hit) == ([HostHit(1), HostHit(0)], 8)
    # a2 needs 3 blocks, all b's (cached, evictable): b held [2, 3, 1, 0] and was freed
    # tail first, so 0, 1 and 3 are the least recently freed. Each is stored before it
    # is reused; a's two blocks are then loaded into the first two
    assert mem.admit_and_compute(a2) == (8, [(0, 2), (1, 3), (3, 4)], [(1, 0), (0, 1)])
    assert a2.block_ids == [0, 1, 3]
    assert bm.counters == {"kv_offload_stored_blocks_total": 5,
                           "kv_offload_loaded_blocks_total": 2}
    mem.expect(a2, a2.num_tokens)


def test_a_prefix_hits_the_device_and_the_host_in_one_chain():
    """The head of a prefix still on the device, its tail back from the host: one chain of
    hits (the stored blocks keep the serials their successors name)."""
    bm = BlockManager(6, BS, True, host_slots=4)
    mem = Memory(bm)
    a = make_seq(0, range(13))  # blocks 0-2 full, 3 partial
    mem.admit_and_compute(a)
    bm.free(a)  # 3 free (uncached), then 2, 1, 0 evictable in that order
    c = make_seq(1, range(50, 70))  # 5 blocks: free 3, 4, 5, then evicts 2 and 1
    assert mem.admit_and_compute(c) == (0, [(2, 0), (1, 1)], [])
    bm.free(c)
    a2 = make_seq(2, list(range(13)) + [99])
    assert bm.get_computed_blocks(a2.all_token_ids) == ([0, HostHit(1), HostHit(0)], 12)
    hit, _, loads = mem.admit_and_compute(a2)
    assert (hit, [slot for slot, _ in loads]) == (12, [1, 0])
    mem.expect(a2, a2.num_tokens)


def test_a_block_computed_again_takes_the_host_entry_so_its_successors_still_hit():
    """A sequence that computes its whole prompt without a lookup (as one scoring its
    prompt does) registers, for a block the host tier holds, the host's entry: the next
    block, still in the host tier, chains on from it."""
    bm = BlockManager(3, BS, True, host_slots=8)
    mem = Memory(bm)
    a = make_seq(0, range(9))
    mem.admit_and_compute(a)
    bm.free(a)
    c = make_seq(1, range(50, 62))  # 3 blocks: the free one, then both of a's evicted
    assert mem.admit_and_compute(c)[1] == [(1, 0), (0, 1)]
    bm.free(c)
    d = make_seq(2, range(5))  # a's first block and one more token
    assert bm.allocate(d, 5)
    d.num_computed_tokens = 5
    bm.cache_full_blocks(d)
    bm.check_integrity()
    bm.free(d)
    # block 0 of the prefix on the device (d's), block 1 in the host tier (a's): both hit
    computed, hit = bm.get_computed_blocks(list(range(9)) + [5])
    assert hit == 8 and computed[1] == HostHit(0) and not isinstance(computed[0], HostHit)


def test_a_pinned_slot_is_not_evicted_by_a_store_of_the_same_step():
    tier = HostTier(2)

    class E:
        def __init__(self, h):
            self.hash = h

    assert tier.store(E(b"a")) == 0 and tier.store(E(b"b")) == 1
    tier.pin(0)  # a is loaded by the step being planned; b is the LRU one now
    assert tier.store(E(b"c")) == 1  # b evicted, not the pinned a
    tier.pin(1)
    assert tier.store(E(b"d")) is None  # every slot pinned: no copy is listed
    assert tier.store(E(b"a")) is None  # held already: no copy, but a is used again
    tier.unpin_all()
    assert tier.store(E(b"d")) == 1  # c, the least recently used, goes
    assert tier.find(b"c") is None and tier.find(b"a")[0] == 0
    tier.check_integrity()


def test_a_full_tier_drops_its_least_recently_used_block():
    bm = BlockManager(2, BS, True, host_slots=2)
    mem = Memory(bm)
    prompts = [list(range(k * 100, k * 100 + 5)) for k in range(4)]  # one full block each
    for k, p in enumerate(prompts):
        s = make_seq(k, p)
        mem.admit_and_compute(s)
        bm.free(s)
    # device: the last two prompts' blocks; host: the first two, stored as evicted; the
    # third's eviction (taking room for the fourth) dropped the first from the host
    assert bm.get_computed_blocks(prompts[0])[1] == 0
    assert bm.get_computed_blocks(prompts[1])[1] == 4
    assert bm.get_computed_blocks(prompts[3])[1] == 4


def test_without_prefix_caching_there_is_no_host_tier():
    assert BlockManager(4, BS, False, host_slots=8).host is None


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_every_hit_holds_its_prompt(seed):
    """Prompts drawn from a few shared prefixes, admitted, computed and freed in random
    order over a small pool and a smaller tier: every block a sequence starts with holds
    exactly its tokens once the step's copies ran, and the books stay whole."""
    rng = random.Random(seed)
    bm = BlockManager(12, BS, True, host_slots=6)
    mem = Memory(bm)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 17))] for _ in range(5)]
    live: list[Sequence] = []
    hits = loads = 0
    for i in range(300):
        if live and (len(live) > 2 or rng.random() < 0.5):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        prompt = rng.choice(stems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        seq = make_seq(i, prompt)
        computed, _ = bm.get_computed_blocks(seq.all_token_ids)
        if not bm.can_allocate(bm.num_blocks_for(seq.num_tokens)):
            continue
        hit, _, step_loads = mem.admit_and_compute(seq)
        hits += hit
        loads += len(step_loads)
        live.append(seq)
        for s in live:
            mem.expect(s, s.num_tokens)
    assert hits > 0 and loads > 0  # the traffic exercised both tiers


@pytest.mark.parametrize("seed", range(8))
def test_loads_landing_steps_later_are_joined_before_a_step_touches_their_blocks(seed):
    """As the random traffic above, but each load lands when the test says (a copy
    stream finishing) or when a step joins it: a sequence with hits waits, steps go on
    without it, it is computed once rank 0 saw its load done (or at once, as a step with
    nothing else takes it); sequences are freed while their loads are on their way and
    their blocks reused. Every computed sequence's blocks hold its tokens."""
    rng = random.Random(seed)
    bm = BlockManager(10, BS, True, host_slots=8)
    mem = Memory(bm)
    stems = [[rng.randrange(1000) for _ in range(rng.randrange(4, 17))] for _ in range(5)]
    admitted: list[Sequence] = []  # blocks taken, tokens not computed yet
    live: list[Sequence] = []  # computed
    held = reused_joins = 0
    for i in range(400):
        if mem.pending and rng.random() < 0.15:  # a copy stream gets this far; rank 0 sees
            batch = rng.choice([b for b, _, _ in mem.pending])
            mem.land(batch)
            bm.host_loads.complete(batch)
        if (live or admitted) and rng.random() < 0.35:  # finished, or aborted while waiting
            pool = live + admitted
            seq = pool[rng.randrange(len(pool))]
            (live if seq in live else admitted).remove(seq)
            bm.free(seq)
        if rng.random() < 0.6:
            prompt = rng.choice(stems) + [rng.randrange(1000)
                                          for _ in range(rng.randrange(1, 6))]
            seq = make_seq(i, prompt)
            computed, hit = bm.get_computed_blocks(seq.all_token_ids)
            if bm.allocate(seq, seq.num_tokens - hit, computed):
                seq.num_computed_tokens = hit
                admitted.append(seq)
        step = [s for s in admitted if not bm.waits_for_load(s)]
        held += len(admitted) - len(step)
        if not step and admitted and rng.random() < 0.5:
            step = list(admitted)  # nothing else to run: the step waits for the loads
        joined_before = bm.host_loads.joined
        must = bm.host_loads._must_join
        mem.run_copies(step)
        reused_joins += must > joined_before
        for seq in step:
            mem.expect(seq, seq.num_computed_tokens)
            mem.compute(seq)
            admitted.remove(seq)
            live.append(seq)
        for seq in live:
            mem.expect(seq, seq.num_tokens)
        bm.check_integrity(live + admitted)
    # the traffic held sequences behind their loads and reused blocks still loading
    assert held > 0 and reused_joins > 0

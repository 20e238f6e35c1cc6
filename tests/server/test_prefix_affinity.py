"""``prefix_affinity``: the block chain of a prompt, the owner of its longest remembered
prefix (30 % of the prompt and ``min_tokens`` at least), the bounded memory, and the rule
that gives the request to the owner unless it is too busy against the least busy
replica."""

from __future__ import annotations

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.prefix_affinity import PrefixAffinity, choose

PLAIN = SamplingParams()


def test_the_chain_covers_whole_blocks_keyed_like_the_prefix_cache():
    a = PrefixAffinity(block_size=4)
    prompt = list(range(10))
    chain = a.chain(prompt, PLAIN)
    assert len(chain) == 2  # the last 2 tokens are no whole block
    assert a.chain(prompt[:8] + [99, 98, 97, 96], PLAIN)[:2] == chain
    assert a.chain([0, 1, 2, 3, 9, 9, 9, 9], PLAIN)[0] == chain[0]
    assert a.chain([0, 1, 2, 3, 9, 9, 9, 9], PLAIN)[1] != chain[1]
    assert a.chain([5, 1, 2, 3, 4, 5, 6, 7], PLAIN)[1] != chain[1]  # each covers all before
    for other in (SamplingParams(cache_salt="s"), SamplingParams(lora_slot=0, lora_id=3)):
        assert a.chain(prompt, other)[0] != chain[0]


def test_the_owner_of_the_longest_prefix_needs_30_percent_of_the_prompt():
    a = PrefixAffinity(block_size=4, min_tokens=4)
    shared = list(range(12))
    a.record(a.chain(shared[:4], PLAIN), 0)
    a.record(a.chain(shared, PLAIN), 1)  # blocks 1-3 now replica 1's
    a.record(a.chain(shared[:4] + [7, 7, 7, 7], PLAIN), 0)  # block 1 back to 0
    long = shared + [50] * 8  # 20 tokens: 3 of its 5 blocks remembered
    assert a.owner(a.chain(long, PLAIN), len(long)) == 1
    branch = shared[:4] + [7, 7, 7, 7] + [60] * 4
    assert a.owner(a.chain(branch, PLAIN), len(branch)) == 0
    short_share = shared[:4] + [70] * 12  # 4 of 16 tokens shared: 25 %
    assert a.owner(a.chain(short_share, PLAIN), len(short_share)) is None
    assert a.owner(a.chain(short_share[:13], PLAIN), 13) == 0  # 4 of 13: 31 %
    assert a.owner(a.chain(long, SamplingParams(cache_salt="x")), len(long)) is None
    floor = PrefixAffinity(block_size=4, min_tokens=12)  # a floor in tokens too
    floor.record(floor.chain(shared, PLAIN), 1)
    assert floor.owner(floor.chain(shared[:8] + [9] * 4, PLAIN), 12) is None  # 8 of 12
    assert floor.owner(floor.chain(long, PLAIN), len(long)) == 1  # 12 of 20


def test_memory_is_bounded_least_recently_used_first():
    a = PrefixAffinity(block_size=2, min_tokens=2, capacity=4)
    first, second, third = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a.record(a.chain(first, PLAIN), 0)
    a.record(a.chain(second, PLAIN), 1)
    a.record(a.chain(first, PLAIN), 0)  # used again: the most recent
    a.record(a.chain(third, PLAIN), 1)
    assert len(a) == 4
    assert a.owner(a.chain(second, PLAIN), 4) is None  # the least recently used: forgotten
    assert a.owner(a.chain(first, PLAIN), 4) == 0
    assert a.owner(a.chain(third, PLAIN), 4) == 1


def test_the_owner_takes_it_unless_too_busy():
    assert choose([3, 0], least=1, owner=None, slack=4) == 1
    assert choose([4, 0], least=1, owner=0, slack=4) == 0  # 4 over: within the slack
    assert choose([5, 0], least=1, owner=0, slack=4) == 1  # 5 over and more than 1.5x
    assert choose([30, 20], least=1, owner=0, slack=4) == 0  # 10 over, but only 1.5x
    assert choose([31, 20], least=1, owner=0, slack=4) == 1
    assert choose([0, 0], least=0, owner=0, slack=1) == 0

"""Prefix affinity for data-parallel routing: requests that share a long prompt prefix go
to the replica that took the last of them, whose prefix cache then likely holds the
prefix's KV blocks, unless that replica is much busier than the least busy one.

The HTTP process cannot see the replicas' caches; it remembers instead which replica it
sent each full KV block of each prompt to (the chain of block hashes, keyed like the
engine's prefix cache: by ``cache_salt`` and LoRA adapter). The rule (``choose``) is that
of the cache-aware routers in front of vLLM and SGLang, with tpserve's scale:

- the owner of the longest remembered prefix takes the request when that prefix is at
  least ``MIN_SHARE`` of the prompt and at least ``MIN_TOKENS`` tokens (a shorter one, such
  as a chat template's header, saves too little prefill to unbalance the replicas for);
- unless it has more than ``slack`` requests in flight beyond the least busy replica and
  more than ``BUSY_RATIO`` times as many (``slack``: an eighth of ``--max-num-seqs``);
- otherwise the least busy replica (``DataParallelEngines`` breaks ties in turn).

Every routed prompt's blocks are then remembered as its replica's (overwriting), the
least recently used forgotten beyond ``capacity`` blocks. State belongs to the event loop
thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tpserve.model.sampling_params import SamplingParams

MIN_SHARE = 0.3  # of the prompt's tokens, for the prefix's owner to take it
MIN_TOKENS = 64  # and at least this many (4 blocks of the default 16 tokens)
BUSY_RATIO = 1.5  # with ``slack``: when the owner is too busy to take it
CAPACITY = 1 << 17  # remembered blocks (about 16 MiB)


def choose(loads: Sequence[int], least: int, owner: int | None, slack: int) -> int:
    """The replica a request goes to: ``owner`` (None: no prefix of ``MIN_SHARE``) unless
    it is too busy against ``least`` (the least busy replica), by ``loads`` (requests in
    flight per replica)."""
    if owner is None:
        return least
    over = loads[owner] - loads[least]
    if over > slack and loads[owner] > BUSY_RATIO * loads[least]:
        return least
    return owner


class PrefixAffinity:
    """Which replica each remembered prompt block went to (module doc)."""

    def __init__(self, block_size: int, min_tokens: int = MIN_TOKENS,
                 capacity: int = CAPACITY):
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.capacity = capacity
        self._owners: OrderedDict[int, int] = OrderedDict()  # block chain hash -> replica

    def chain(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The hashes of the prompt's full blocks, each covering every token before its
        block's end, keyed as the engine's prefix cache keys them."""
        h = hash((params.cache_salt, params.lora_id))
        hashes = []
        for end in range(self.block_size, len(prompt) + 1, self.block_size):
            h = hash((h, tuple(prompt[end - self.block_size:end])))
            hashes.append(h)
        return hashes

    def owner(self, chain: list[int], prompt_len: int) -> int | None:
        """The replica that took the longest remembered prefix of ``chain``, when it covers
        at least ``MIN_SHARE`` of the prompt's ``prompt_len`` tokens and ``min_tokens``."""
        floor = max(MIN_SHARE * prompt_len, self.min_tokens)
        for depth in range(len(chain), 0, -1):
            if depth * self.block_size < floor:
                return None
            replica = self._owners.get(chain[depth - 1])
            if replica is not None:
                return replica
        return None

    def record(self, chain: list[int], replica: int) -> None:
        """``chain``'s blocks went to ``replica``."""
        owners = self._owners
        for h in chain:
            owners[h] = replica
            owners.move_to_end(h)
        while len(owners) > self.capacity:
            owners.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owners)

"""Paged KV-cache block allocator with reference counts and a hashed prefix cache.

Every block id ``0..num_blocks-1`` is in exactly one of three places:

- **used**: refcount >= 1, held by one or more sequences' block tables;
- **free**: refcount 0 and holds no cached hash (never-cached or dropped); a LIFO stack,
  so a freshly built manager hands out ``0, 1, 2, ...`` and the most recently freed
  block is reused first;
- **evictable**: refcount 0 but still registered in the prefix cache, so a later
  lookup can revive it; an LRU queue (front = least recently freed = evicted first).

Allocation takes free blocks first and only then evicts the LRU evictable block,
dropping its hash. Sequences are freed tail first, so a sequence's last blocks are
evicted before its first ones (which are the ones other prompts are likely to share).

Prefix cache: the hash of a sequence's full block ``i`` is chained through its parent,
``h_i = hash_fn(h_{i-1}, tokens_i, extra_key)`` with ``h_{-1}`` a random per-manager root
(``prefix_hash``: sha256, so collisions cannot be built offline). The cache maps
``hash -> block id``. Hits never rely on the hash alone: each cached block records a
unique, never reused *serial* and its key ``(parent serial, tokens, extra_key)``, where the
parent serial names the cache entry that holds exactly the content of the block before it
(0 for the root). A lookup hits block ``i`` only when the entry's key equals (serial of the
entry it matched at ``i - 1``, the block's tokens, extra_key); by induction the whole
prefix, not just the last block, equals the one the K/V was computed from, whatever the
hash function. A block whose chain cannot be verified (its predecessor collided with a
cache entry of other content) is never registered. An evicted entry's serial is gone for
good, so its cached descendants become unreachable and age out through the LRU queue.
A block is registered only once it is full and its K/V computed; from then on nobody
writes to it, so sharing it is safe.

All operations on the hot path (allocate, free, lookup per block) are O(1) per block.

Host tier (``host_slots > 0``, ``--kv-offloading-size``; ``host_tier.py``): a cached block
that allocation evicts is first listed to be copied to a host slot, under its entry; a
lookup that misses the device cache at block ``i`` may hit the host tier there (the same
key check), and ``allocate`` then takes a fresh device block for it, registers the entry
on it (the same serial: the content is the same) and lists a copy back. The runners must
run the listed copies (``take_copies``) before the step planned with them: every store,
then every load, in order. A block whose load is listed has its entry pinned in the host
tier until then, so no store of the same step evicts it or is listed for its block.
Loads run beside the steps (``host_loads.py``): a sequence holding a block a load may
still be writing waits (``waits_for_load``) until rank 0 sees the load done, and the
first step that computes it, or takes such a block for other content, joins the load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

from tpserve.server.engine.host_loads import HostLoads
from tpserve.server.engine.host_tier import HostTier
from tpserve.server.engine.prefix_hash import BlockHashFn, random_root, sha256_block_hash
from tpserve.server.engine.sequence import Sequence

ROOT_SERIAL = 0  # the parent serial of every sequence's block 0; entries count from 1


class CacheEntry(NamedTuple):
    """A cached block: its hash and serial, and the key a hit must match exactly."""

    hash: bytes
    serial: int
    parent_hash: bytes
    parent_serial: int
    tokens: tuple[int, ...]
    extra_key: bytes


def _key(e: CacheEntry) -> tuple[int, tuple[int, ...], bytes]:
    """What a hit must match (besides the hash): the parent's serial, tokens, extra key."""
    return e.parent_serial, e.tokens, e.extra_key


class HostHit(NamedTuple):
    """A prefix-cache hit in the host tier (``get_computed_blocks``): its slot."""

    slot: int


class KVCopies(NamedTuple):
    """A step's copies between the pool and the host tier (``take_copies``): stores
    ``(device block, host slot)``, then loads ``(host slot, device block)``, ``batches[i]``
    the batch of ``loads[i]`` (ascending), and the newest load batch the step joins (-1:
    none)."""

    stores: list[tuple[int, int]]
    loads: list[tuple[int, int]]
    batches: list[int]
    join: int = -1

    @property
    def needed(self) -> bool:
        return bool(self.stores or self.loads) or self.join >= 0


class BlockManager:
    """Hands out KV blocks to sequences and caches full blocks by content.

    Invariants (see ``check_integrity``):
    - free + evictable + used == num_blocks, each block in exactly one of them;
    - ``refcount > 0`` exactly for used blocks;
    - a block has a cache entry iff it is in the cache map under the entry's hash; free
      blocks have none, evictable blocks always have one; an entry's hash is
      ``hash_fn(parent_hash, tokens, extra_key)`` and its parent serial is older than it;
    - per sequence, ``_seq_links[seq_id]`` lists, for its first full blocks in order, the
      chained hash computed from its tokens and the serial of the cache entry holding the
      same content (None when that content's chain could not be verified), whether or not
      the sequence's own blocks are the cached ones.

    ``hash_fn`` and ``root`` are seams for tests (e.g. a deliberately colliding hash).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 hash_fn: BlockHashFn = sha256_block_hash, root: bytes | None = None,
                 host_slots: int = 0):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        # Free (uncached) blocks, a stack: the last entry is handed out first.
        self._free: list[int] = list(reversed(range(num_blocks)))
        # Refcount-0 cached blocks in LRU order: the first key is evicted first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_fn = hash_fn
        self._root = random_root() if root is None else root
        self._entry_of: list[CacheEntry | None] = [None] * num_blocks
        self._cache: dict[bytes, int] = {}
        self._next_serial = ROOT_SERIAL + 1
        self._seq_links: dict[int, list[tuple[bytes, int | None]]] = {}
        self.host = HostTier(host_slots) if host_slots and enable_prefix_caching else None
        # copies the runners owe before the next step: (device block, host slot) stores,
        # then (host slot, device block) loads; see ``take_copies``
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._load_batches: list[int] = []  # each listed load's batch
        self.host_loads = HostLoads()  # the loads no step has joined yet
        self.counters = {"kv_offload_stored_blocks_total": 0,
                         "kv_offload_loaded_blocks_total": 0}

    # ----------------------------------------------------------------- accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._entry_of[block_id] is not None

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- prefix cache

    def get_computed_blocks(self, token_ids: SequenceABC[int], extra_key: bytes = b""
                            ) -> tuple[list[int | HostHit], int]:
        """The longest cached prefix of full blocks, and the number of tokens it covers:
        device block ids, or ``HostHit`` where only the host tier holds the block.

        Never covers all of ``token_ids``: at least one token is left to compute (its
        logits are needed), so at most ``(len(token_ids) - 1) // block_size`` blocks.
        Every returned block's whole chain was compared token by token (see the module
        docstring). Takes no references; pass the blocks to ``allocate`` right away.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        blocks: list[int | HostHit] = []
        parent, parent_serial = self._root, ROOT_SERIAL
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self._hash_fn(parent, tokens, extra_key)
            block_id = self._cache.get(h)
            held = None if block_id is not None or self.host is None else self.host.find(h)
            if held is not None:
                hit, entry = HostHit(held[0]), held[1]
            elif block_id is not None:
                hit, entry = block_id, self._entry_of[block_id]
            else:
                break
            if _key(entry) != (parent_serial, tokens, extra_key):
                break  # a collision: another prefix's block under this hash
            blocks.append(hit)
            parent, parent_serial = h, entry.serial
        return blocks, len(blocks) * bs

    def cache_full_blocks(self, seq: Sequence, extra_key: bytes = b"") -> None:
        """Register the blocks of ``seq`` that became full and computed since last time.

        ``extra_key`` must be the same on every call for one sequence. A block whose hash
        is already cached (the same content computed twice, or a collision) is left
        unregistered, so it returns to the free list when released; so is a block whose
        predecessor's chain could not be verified.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
        links = self._seq_links.setdefault(seq.seq_id, [])
        for i in range(len(links), num_full):
            parent, parent_serial = links[-1] if links else (self._root, ROOT_SERIAL)
            tokens = tuple(seq.token_slice(i * bs, (i + 1) * bs))
            h = self._hash_fn(parent, tokens, extra_key)
            block_id = seq.block_ids[i]
            own = self._entry_of[block_id]
            if own is not None:
                # Shared from the cache or a fork: the sequence attends to exactly this block.
                assert own.tokens == tokens, f"block {block_id} holds other tokens"
                links.append((h, own.serial))
                continue
            if parent_serial is None:
                links.append((h, None))
                continue
            cached = self._cache.get(h)
            if cached is not None:
                entry = self._entry_of[cached]
                same = _key(entry) == (parent_serial, tokens, extra_key)
                links.append((h, entry.serial if same else None))
                continue
            held = self.host.find(h) if self.host is not None else None
            if held is not None:  # computed again: the host tier's entry names this content
                entry = held[1]
                if _key(entry) == (parent_serial, tokens, extra_key):
                    self._cache[h] = block_id
                    self._entry_of[block_id] = entry
                    links.append((h, entry.serial))
                else:
                    links.append((h, None))
                continue
            serial = self._next_serial
            self._next_serial += 1
            self._cache[h] = block_id
            self._entry_of[block_id] = CacheEntry(h, serial, parent, parent_serial, tokens,
                                                  extra_key)
            links.append((h, serial))

    def reset_prefix_cache(self, host: bool = True) -> None:
        """Forgets every cached device block (vLLM's ``reset_prefix_cache``; sleep mode,
        whose pool loses its content), and with ``host`` the host tier's too (new weights);
        without, the tier's blocks stay findable (a hit's chain is verified from the root,
        so one whose predecessors are gone is a miss). Only while no block is in use and no
        copy is listed (``take_copies`` first). A block a host load may still be writing is
        joined by the next step before it can be written again (``HostLoads.reused``), as
        when an evicted one is reused."""
        assert self.num_used_blocks == 0, "the prefix cache reset with blocks in use"
        assert not (self._stores or self._loads), "the prefix cache reset with copies listed"
        for b in range(self.num_blocks):
            if self.host_loads.batch_of(b) >= 0:
                self.host_loads.reused(b)
        self._free = list(reversed(range(self.num_blocks)))
        self._evictable.clear()
        self._entry_of = [None] * self.num_blocks
        self._cache.clear()
        self._seq_links.clear()
        if host and self.host is not None:
            self.host = HostTier(self.host.num_slots)

    # ----------------------------------------------------------------- allocation

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 computed_blocks: list[int | HostHit] | None = None) -> bool:
        """Grow ``seq.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` tokens.

        With ``computed_blocks`` (first admission with prefix-cache hits, from
        ``get_computed_blocks``), ``seq`` must hold no blocks; the hits are taken first
        (refcount + 1, revived from the evictable queue; a host hit gets a fresh block and
        a listed load) and count as computed, i.e. the table covers
        ``len(computed_blocks) * block_size + num_new_tokens`` tokens; the caller then sets
        ``seq.num_computed_tokens`` to that prefix.

        All or nothing: returns False and changes nothing when too few blocks are free.
        """
        computed = computed_blocks or []
        if computed:
            assert not seq.block_ids, f"seq {seq.seq_id} already holds blocks"
            base = len(computed) * self.block_size
            assert seq.num_computed_tokens in (0, base), (
                f"seq {seq.seq_id}: num_computed_tokens={seq.num_computed_tokens} does not "
                f"match {len(computed)} computed blocks")
        else:
            base = seq.num_computed_tokens
        needed = self.num_blocks_for(base + num_new_tokens) - len(seq.block_ids) - len(computed)
        hosted = [hit.slot for hit in computed if isinstance(hit, HostHit)]
        revived = sum(1 for b in computed
                      if not isinstance(b, HostHit) and self._refcount[b] == 0)
        if max(needed, 0) + len(hosted) > self.num_free_blocks - revived:
            return False
        for slot in hosted:  # before any block is taken: taking one may store to the tier
            self.host.pin(slot)
        for b in computed:
            if isinstance(b, HostHit):
                continue
            assert self._entry_of[b] is not None, f"computed block {b} is not cached"
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1
        wait = -1  # the newest load batch a block of seq's waits for
        batch = self.host_loads.new_batch() if hosted else -1
        for b in computed:
            if isinstance(b, HostHit):
                b = self._load(b.slot, batch)
            wait = max(wait, self.host_loads.batch_of(b))
            seq.block_ids.append(b)
        self.host_loads.wait(seq.seq_id, wait)
        for _ in range(needed):
            seq.block_ids.append(self._take_block())
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Let ``child`` share ``parent``'s first ``num_tokens // block_size`` full blocks.

        The shared blocks must be computed in ``parent`` and hold the same tokens as the
        child's prefix (siblings share the prompt). ``child`` must hold no blocks; it ends
        with those blocks (refcount + 1) and that many tokens computed.
        """
        k = num_tokens // self.block_size
        n = k * self.block_size
        assert not child.block_ids, f"seq {child.seq_id} already holds blocks"
        assert n <= parent.num_computed_tokens and k <= len(parent.block_ids), (
            f"parent seq {parent.seq_id} has not computed {n} tokens")
        assert child.token_slice(0, n) == parent.token_slice(0, n), (
            f"seq {child.seq_id} does not share its first {n} tokens with seq {parent.seq_id}")
        shared = parent.block_ids[:k]
        for b in shared:
            self._refcount[b] += 1
        child.block_ids = list(shared)
        # the parent may be waiting for these blocks' loads still (prefix hits)
        self.host_loads.wait(child.seq_id, max(map(self.host_loads.batch_of, shared),
                                               default=-1))
        child.num_computed_tokens = n

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, and clear its block table."""
        for b in reversed(seq.block_ids):
            self._refcount[b] -= 1
            assert self._refcount[b] >= 0, f"block {b} freed more often than taken"
            if self._refcount[b] == 0:
                if self._entry_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        seq.block_ids = []
        self._seq_links.pop(seq.seq_id, None)
        self.host_loads.forget(seq.seq_id)

    def waits_for_load(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds a block whose load rank 0 has not yet seen done (hold it
        back while other sequences can run)."""
        return self.host_loads.waits(seq.seq_id)

    def _take_block(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            self.host_loads.reused(b)
            entry = self._entry_of[b]
            del self._cache[entry.hash]
            self._entry_of[b] = None
            slot = self.host.store(entry) if self.host is not None else None
            if slot is not None:
                self._stores.append((b, slot))
                self.counters["kv_offload_stored_blocks_total"] += 1
        self._refcount[b] = 1
        return b

    def _load(self, slot: int, batch: int) -> int:
        """A fresh block (refcount 1) registered under host ``slot``'s entry, its load
        listed in ``batch``. The slot is pinned, so its hash is in no device block."""
        entry = self.host.entry(slot)
        b = self._take_block()
        assert entry.hash not in self._cache, "a host hit whose hash the device holds"
        self._cache[entry.hash] = b
        self._entry_of[b] = entry
        self._loads.append((slot, b))
        self._load_batches.append(batch)
        self.host_loads.loading(b, batch)
        self.counters["kv_offload_loaded_blocks_total"] += 1
        return b

    def take_copies(self, scheduled: Iterable[Sequence] = ()) -> KVCopies:
        """The copies listed since the last call, handed to the runners with the step of
        sequences ``scheduled``: stores, then loads (a batch per admission), each in the
        order they must run, and the load batch the step joins first (``host_loads.py``).
        Unpins the tier."""
        copies = KVCopies(self._stores, self._loads, self._load_batches,
                          self.host_loads.take(s.seq_id for s in scheduled))
        self._stores, self._loads, self._load_batches = [], [], []
        if self.host is not None:
            self.host.unpin_all()
        return copies

    # ----------------------------------------------------------------- checking

    def check_integrity(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise AssertionError unless the invariants hold.

        With ``seqs`` (every sequence that holds blocks), also check that each block's
        refcount equals the number of block tables listing it.
        """
        n = self.num_blocks
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        used = {b for b in range(n) if self._refcount[b] > 0}
        assert all(0 <= b < n for b in free | evictable), "block id out of range"
        assert not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}"
        assert not used & free, f"used blocks on the free list: {sorted(used & free)}"
        assert not used & evictable, f"used blocks evictable: {sorted(used & evictable)}"
        assert len(free) + len(evictable) + len(used) == n, (
            f"free {len(free)} + evictable {len(evictable)} + used {len(used)} != total {n}; "
            f"lost: {sorted(set(range(n)) - free - evictable - used)}")
        negative = [b for b in range(n) if self._refcount[b] < 0]
        assert not negative, f"negative refcounts: {negative}"
        for b in free:
            assert self._entry_of[b] is None, f"free block {b} still has a hash"
        for b in evictable:
            assert self._entry_of[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._cache.items():
            e = self._entry_of[b]
            assert e is not None and e.hash == h, (
                f"cache maps hash {h!r} to block {b}, whose entry is {e}")
            assert self._hash_fn(e.parent_hash, e.tokens, e.extra_key) == h, (
                f"block {b}: key does not hash to {h!r}")
            assert e.parent_serial < e.serial < self._next_serial, f"block {b}: bad serials"
            assert len(e.tokens) == self.block_size, f"cached block {b} is not full"
        num_hashed = sum(e is not None for e in self._entry_of)
        assert num_hashed == len(self._cache), (
            f"{num_hashed} blocks carry a hash but the cache holds {len(self._cache)}")
        if not self.enable_prefix_caching:
            assert not self._cache, "prefix cache populated while disabled"
        if self.host is not None:
            self.host.check_integrity()
            for h, b in self._cache.items():  # one content, one serial, in either tier
                held, e = self.host.find(h), self._entry_of[b]
                if held is not None and _key(held[1]) == _key(e):
                    assert held[1].serial == e.serial, (
                        f"block {b} and host slot {held[0]} hold one content, two serials")
        seqs = None if seqs is None else list(seqs)
        self.host_loads.check_integrity(
            self.is_cached, None if seqs is None else {s.seq_id for s in seqs})
        if seqs is not None:
            counts = [0] * n
            for seq in seqs:
                for b in seq.block_ids:
                    counts[b] += 1
            pairs = enumerate(zip(self._refcount, counts, strict=True))
            wrong = [(b, r, c) for b, (r, c) in pairs if r != c]
            assert not wrong, f"(block, refcount, references) mismatches: {wrong[:10]}"

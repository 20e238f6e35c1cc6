"""A rank's host tier of the KV cache (``--kv-offloading-size``): host memory holding
whole KV blocks of this rank's pool, and the copies between it and the pool.

Layout: ``host[slot]`` is one block of every layer, K and V, contiguous
(``[num_layers * 2, block_size * kv_heads * head_dim]``), so a block crosses the bus as
one copy. The pool keeps each layer's blocks apart (``KVPool``), so a batch of blocks is
gathered into a device staging buffer first (one ``index_select``), turned block-major in
a second one, then copied; loads run the same way back. Stores and loads have staging
buffers of their own, allocated once, at start-up (``staging_bytes`` is part of the
memory plan's workspace), and copies go in batches of at most ``staging_blocks`` blocks:
the steady state allocates nothing.

Invariants:
- stores run on the stream the forward runs on, in the order the block manager listed
  them, before the step they were planned with, so a block is stored before a step
  writes over it; a store into a slot that a load still reads waits for that load;
- on CUDA loads (in *batches*, one per admission, numbered by the block manager) run on
  a copy stream of their own, in order, after everything the forward stream was given
  before them (the step's stores, and earlier steps that may still read a block being
  reloaded), and beside the step's forward; ``join(batch)`` makes the forward stream wait
  for every load up to ``batch`` (the engine joins a batch before any step reads or
  reuses a block it writes: ``server/engine/host_loads.py``); ``done_batch`` reads,
  without waiting, how far they have got. Off CUDA loads run in place and are done at
  once;
- on CUDA the host memory is page-locked (``cudaHostRegister``, for exactly the size
  asked) and the copies do not wait for the device; the host never reads the tier itself.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch

from tpserve.model.host_copy import lock_in_place, unlock
from tpserve.model.kv_pool import KVPool

STAGING_BYTES = 64 * 2**20  # one direction's two staging buffers, at most (at least 2 blocks)
# copies move bits: every KV dtype is viewed as the integer type of its size (fp8 has no
# index_select on every device)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def host_slots(total_bytes: int, tp: int, bytes_per_block: int) -> int:
    """Slots a rank's tier gets from ``--kv-offloading-size`` (``total_bytes``, summed
    over the ``tp`` ranks, as vLLM counts it); every rank gets the same number."""
    return total_bytes // tp // bytes_per_block


def staging_blocks(bytes_per_block: int, num_slots: int) -> int:
    """Blocks one batch of copies moves: what half of ``STAGING_BYTES`` holds (at least
    one), and never more than the tier's slots."""
    return max(1, min(STAGING_BYTES // 2 // bytes_per_block, num_slots))


class _Staging:
    """One direction's device buffers: a batch of blocks by row (as the pool keeps them)
    and by block (as the host does), and the batch's block ids."""

    def __init__(self, blocks: int, rows: int, row: int, dtype: torch.dtype,
                 device: torch.device, pin: bool):
        self.rows, self.row, self.pin = rows, row, pin
        self.by_row = torch.empty(blocks * rows * row, dtype=dtype, device=device)
        self.by_block = torch.empty(blocks * rows * row, dtype=dtype, device=device)
        self.index = torch.empty(blocks, dtype=torch.int64, device=device)

    def views(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The index of ``blocks`` (copied in on the current stream) and both buffers,
        shaped for them."""
        k, n = len(blocks), len(blocks) * self.rows * self.row
        index = self.index[:k]
        ids = torch.tensor(blocks, dtype=torch.int64)
        if self.pin:  # a blocking copy would wait for the step before to finish
            ids = ids.pin_memory()
        index.copy_(ids, non_blocking=True)
        return (index, self.by_row[:n].view(self.rows, k, self.row),
                self.by_block[:n].view(k, self.rows, self.row))


class HostKV:
    """``num_slots`` blocks of host memory beside ``pool``, and the copies between them."""

    def __init__(self, pool: KVPool, num_slots: int, bytes_per_block: int):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        buf = pool.buffer.view(_BITS[pool.buffer.element_size()])
        layers, _, self.num_pool_blocks, *block = buf.shape
        self.rows = layers * 2  # a block's (layer, K or V) rows
        self.row = block[0] * block[1] * block[2]  # elements of one row
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.pool_rows = buf.view(self.rows, self.num_pool_blocks, self.row)
        cuda = buf.device.type == "cuda"
        try:
            self.host = torch.empty((num_slots, self.rows, self.row), dtype=buf.dtype)
            if cuda:
                lock_in_place(self.host)
                weakref.finalize(self, unlock, self.host)  # before the memory is freed
        except RuntimeError as e:
            raise MemoryError(
                f"--kv-offloading-size: could not allocate {num_slots} KV blocks "
                f"({num_slots * bytes_per_block / 2**30:.1f} GiB) of "
                f"{'pinned ' if cuda else ''}host memory on this rank: {e}") from None
        self.staging_blocks = staging_blocks(bytes_per_block, num_slots)
        self._out, self._in = (_Staging(self.staging_blocks, self.rows, self.row, buf.dtype,
                                        buf.device, cuda) for _ in range(2))
        self._stream = torch.cuda.Stream(buf.device) if cuda else None
        # loads not yet joined and maybe running: (batch, end event, host slots they read)
        self._pending: deque[tuple[int, torch.cuda.Event, frozenset[int]]] = deque()
        self._issued = -1  # the newest batch of loads given
        if cuda:
            self._warm_up()

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    @staticmethod
    def staging_bytes(bytes_per_block: int, num_slots: int) -> int:
        """Device bytes of the staging buffers (and indices) of both directions, for a
        tier of ``num_slots`` blocks this big."""
        k = staging_blocks(bytes_per_block, num_slots)
        return 2 * (2 * k * bytes_per_block + 8 * k)

    def store(self, blocks: list[int], slots: list[int]) -> None:
        """Copies pool ``blocks[i]`` into host ``slots[i]``, in batches, in order, after
        any load still reading one of ``slots``."""
        self._after_loads_of(slots)
        for i in range(0, len(blocks), self.staging_blocks):
            index, by_row, by_block = self._out.views(blocks[i:i + self.staging_blocks])
            torch.index_select(self.pool_rows, 1, index, out=by_row)
            by_block.copy_(by_row.transpose(0, 1))
            for j, slot in enumerate(slots[i:i + self.staging_blocks]):
                self.host[slot].copy_(by_block[j], non_blocking=True)

    def load(self, slots: list[int], blocks: list[int], batch: int) -> None:
        """Copies host ``slots[i]`` into pool ``blocks[i]``, in batches, in order, as (part
        of) load batch ``batch``: on CUDA beside the forward, until ``join``."""
        self._issued = max(self._issued, batch)
        if self._stream is None:
            self._load(slots, blocks)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self._load(slots, blocks)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending.append((batch, done, frozenset(slots)))

    def join(self, batch: int) -> None:
        """The forward stream waits for every load up to ``batch`` (on the device)."""
        last = None
        while self._pending and self._pending[0][0] <= batch:
            last = self._pending.popleft()[1]
        if last is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(last)

    def done_batch(self) -> int:
        """The newest batch every load up to which is done or joined (never waits)."""
        while self._pending and self._pending[0][1].query():
            self._pending.popleft()
        return self._pending[0][0] - 1 if self._pending else self._issued

    def _warm_up(self) -> None:
        """Launches every copy kernel once and waits for them (CUDA, at start-up). CUDA
        loads a kernel at its first launch, and that waits for the device: the first load
        of a serving engine would otherwise hold the host until the step in flight ended
        (26 ms behind a busy stream on an H100, ``bench/README.md`` round 46). Copies pool
        block 0 to slot 0 and back, which changes no byte of the pool, and touches no
        batch bookkeeping."""
        self.store([0], [0])
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self._load([0], [0])  # after the store: slot 0 holds block 0's bytes
        torch.cuda.synchronize(self._stream.device)

    def _after_loads_of(self, slots: list[int]) -> None:
        """The forward stream waits for the newest pending load reading one of ``slots``."""
        if not self._pending:
            return
        wanted = set(slots)
        for _, done, read in reversed(self._pending):
            if read & wanted:
                torch.cuda.current_stream(self._stream.device).wait_event(done)
                return

    def _load(self, slots: list[int], blocks: list[int]) -> None:
        for i in range(0, len(blocks), self.staging_blocks):
            index, by_row, by_block = self._in.views(blocks[i:i + self.staging_blocks])
            for j, slot in enumerate(slots[i:i + self.staging_blocks]):
                by_block[j].copy_(self.host[slot], non_blocking=True)
            by_row.copy_(by_block.transpose(0, 1))
            self.pool_rows.index_copy_(1, index, by_row)

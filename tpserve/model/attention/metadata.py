"""The per-step attention inputs shared by every attention back-end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Query rows per tile of the prefill kernel; the tile table below is built for it.
PREFILL_TILE_M = 64
_TILE_SHIFT = 16  # a tile entry is (sequence << 16) | query block


def prefill_tiles(query_lens: list[int], first_seq: int, tile_m: int = PREFILL_TILE_M
                  ) -> list[int]:
    """The prefill kernel's work list: one entry per ``tile_m`` new tokens of each sequence
    ``first_seq ..``, packed as ``(sequence << 16) | query_block``."""
    tiles = []
    for i, n in enumerate(query_lens):
        seq = (first_seq + i) << _TILE_SHIFT
        tiles.extend(seq | m for m in range(-(-n // tile_m)))
    return tiles


def max_prefill_tiles(num_tokens: int, num_seqs: int, tile_m: int = PREFILL_TILE_M) -> int:
    """An upper bound on ``len(prefill_tiles(...))`` for any step of ``num_tokens`` new
    tokens over at most ``num_seqs`` sequences (each sequence wastes at most one tile)."""
    return -(-num_tokens // tile_m) + min(num_seqs, num_tokens)


@dataclass
class AttentionMetadata:
    """Attention inputs for one step over a flat batch of T new tokens from B sequences.

    Invariants:
    - Sequences are ordered decodes first: the first ``num_decodes`` sequences have exactly
      one new token each (so tokens ``0..num_decodes-1`` are theirs); the rest have >= 1.
    - ``query_start_loc`` (int32, [B+1]) is the cumulative count of new tokens; sequence
      ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.
    - ``seq_lens`` (int32, [B]) is each sequence's context length after this step (tokens
      already in the pool plus the new ones); new token ``j`` of sequence ``i`` sits at
      position ``seq_lens[i] - q_len_i + j`` and attends causally to positions ``<=`` it.
    - ``block_tables`` (int32, [B, max_blocks]) maps logical block ``b`` of sequence ``i``
      to a physical block of the KV pool; entries past ``ceil(seq_lens[i] / block_size)``
      are padding and never read.
    - ``slot_mapping`` (int64, [T]) is the flat slot ``block * block_size + offset`` where
      each new token's K and V are written (a negative slot means "do not write": padding).
    - ``max_query_len`` and ``max_seq_len`` are host integers for kernel launch grids.

    Launch shapes that CUDA graphs fix (the torch reference ignores these three):
    - ``decode_slots`` (host int, >= ``num_decodes``): the decode kernel runs over the first
      ``decode_slots`` token rows with context lengths ``decode_seq_lens`` ([decode_slots],
      0 past ``num_decodes``); a slot of length 0 writes zeros into its row, which the
      prefill kernel, launched after it, overwrites where the row is a prefill token.
    - ``prefill_tiles`` (int32): the prefill kernel's work list (``prefill_tiles()``),
      padded with -1 entries that do nothing. ``None`` means "build it from
      ``query_start_loc``" (one host sync; tests and tools only).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    prefill_tiles: torch.Tensor | None = None
    decode_slots: int | None = None
    decode_seq_lens: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_decode_slots(self) -> int:
        return self.num_decodes if self.decode_slots is None else self.decode_slots

    def decode_lens(self) -> torch.Tensor:
        if self.decode_seq_lens is not None:
            return self.decode_seq_lens
        return self.seq_lens[: self.num_decodes]

    def tiles(self) -> torch.Tensor:
        if self.prefill_tiles is not None:
            return self.prefill_tiles
        qsl = self.query_start_loc.tolist()
        lens = [b - a for a, b in zip(qsl[self.num_decodes:-1], qsl[self.num_decodes + 1:],
                                       strict=True)]
        return torch.tensor(prefill_tiles(lens, self.num_decodes), dtype=torch.int32,
                            device=self.query_start_loc.device)

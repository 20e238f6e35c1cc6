"""The per-step attention inputs shared by every attention back-end (``attention.backend``);
what one back-end needs beyond them lives in its own metadata (e.g. ``TritonMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

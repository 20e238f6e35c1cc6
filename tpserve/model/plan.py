"""A step's plan: the tensors every rank needs to run one forward, packed for broadcast.

Rank 0 builds the plan from its scheduler's decisions and broadcasts it as two int64
tensors (a fixed-size header, then the payload); workers unpack the same plan. Nothing is
pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.model.attention.metadata import AttentionMetadata

HEADER_LEN = 8
CMD_STEP, CMD_SHUTDOWN, CMD_NOOP, CMD_PROFILE = 1, 2, 3, 4


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: ``token_ids`` are its new tokens, starting at
    position ``num_computed``; ``block_ids`` cover ``num_computed + len(token_ids)``
    tokens; ``sample`` asks for logits of its last new token."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    sample: bool


@dataclass
class StepPlan:
    input_ids: torch.Tensor       # int64 [T]
    positions: torch.Tensor       # int64 [T]
    slot_mapping: torch.Tensor    # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor        # int32 [B]
    block_tables: torch.Tensor    # int32 [B, M]
    logits_indices: torch.Tensor  # int64 [S]
    num_decodes: int
    max_query_len: int
    max_seq_len: int

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int) -> StepPlan:
        """Chunks must come decodes first (single-token chunks of running sequences)."""
        ids, pos, slots, qsl, lens, sample_idx = [], [], [], [0], [], []
        num_decodes = 0
        for c in chunks:
            n = len(c.token_ids)
            if n == 1 and num_decodes == len(lens):
                num_decodes += 1
            ids.extend(c.token_ids)
            p = range(c.num_computed, c.num_computed + n)
            pos.extend(p)
            slots.extend(c.block_ids[i // block_size] * block_size + i % block_size for i in p)
            qsl.append(qsl[-1] + n)
            lens.append(c.num_computed + n)
            if c.sample:
                sample_idx.append(qsl[-1] - 1)
        width = max((len(c.block_ids) for c in chunks), default=1) or 1
        table = torch.zeros((len(chunks), width), dtype=torch.int32)
        for i, c in enumerate(chunks):
            table[i, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
        return cls(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), table,
            torch.tensor(sample_idx, dtype=torch.int64), num_decodes,
            max((len(c.token_ids) for c in chunks), default=0), max(lens, default=0))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(header, payload)``: the header holds the sizes needed to receive the payload."""
        b, m = self.block_tables.shape
        header = torch.tensor([CMD_STEP, self.num_tokens, b, m, self.logits_indices.shape[0],
                               self.num_decodes, self.max_query_len, self.max_seq_len],
                              dtype=torch.int64)
        payload = torch.cat([self.input_ids, self.positions, self.slot_mapping,
                             self.query_start_loc.long(), self.seq_lens.long(),
                             self.block_tables.flatten().long(), self.logits_indices])
        return header, payload

    @staticmethod
    def payload_len(header: torch.Tensor) -> int:
        _, t, b, m, s = (int(x) for x in header[:5].tolist())
        return 3 * t + (b + 1) + b + b * m + s

    @classmethod
    def unpack(cls, header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
        _, t, b, m, s, nd, mq, ms = (int(x) for x in header.tolist())
        parts = payload.split([t, t, t, b + 1, b, b * m, s])
        return cls(parts[0], parts[1], parts[2], parts[3].int(), parts[4].int(),
                   parts[5].int().view(b, m), parts[6], nd, mq, ms)

    def to(self, device: torch.device) -> StepPlan:
        move = {k: getattr(self, k).to(device, non_blocking=True) for k in (
            "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
            "block_tables", "logits_indices")}
        return StepPlan(**move, num_decodes=self.num_decodes,
                        max_query_len=self.max_query_len, max_seq_len=self.max_seq_len)

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.query_start_loc, self.seq_lens,
                                 self.block_tables, self.num_decodes, self.max_query_len,
                                 self.max_seq_len)

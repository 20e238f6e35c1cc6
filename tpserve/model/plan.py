"""A step's plan: the tensors every rank needs to run one forward, packed for broadcast.

Rank 0 builds the plan from its scheduler's decisions and broadcasts it as two int64
tensors (a fixed-size header, then the payload); workers unpack the same plan. Nothing is
pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.attention.metadata import AttentionMetadata

HEADER_LEN = 13
KV_BLOCK_SIZES = (8, 16, 32, 64, 128)  # what the attention kernels are built for
CMD_STEP, CMD_SHUTDOWN, CMD_NOOP = 1, 2, 3
# rank 0 asks for every rank's allocator figures: each rank answers with one all-gather
CMD_MEMORY = 4
# rank 0 has every rank load a LoRA adapter into a slot (header: slot, path bytes; the path
# as the payload); every rank answers with one all-gather of whether it could
CMD_LORA = 5
# rank 0 has every rank copy KV blocks between its pool and its host tier before the next
# step (header: stores, loads; payload: store blocks, store slots, load slots, load blocks)
CMD_KV_COPY = 6
# sleep mode (model/sleep.py): rank 0 has every rank give back its device memory (header:
# level) or take it back (header: weights, KV pool); every rank answers with one all-reduce
# of whether it could, then one all-gather of its figures
CMD_SLEEP, CMD_WAKE = 7, 8
# rank 0 has every rank read a checkpoint into its weights in place (header: the path's
# byte count; the path as the payload; model/reload.py)
CMD_RELOAD = 9


@dataclass(frozen=True, kw_only=True)
class StepLimits:
    """The bounds of every plan a runner is sent, fixed at start-up (the scheduler's limits:
    ``SchedulerConfig.limits``): at most ``max_num_seqs`` sequences and
    ``max_num_batched_tokens`` new tokens per step, sequences of at most ``max_model_len``
    tokens addressed in KV blocks of ``block_size`` tokens. The runner sizes its receive
    buffers, its memory profile, its KV pool and its CUDA graphs by them."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size not in KV_BLOCK_SIZES:
            raise ValueError(f"--block-size must be one of "
                             f"{', '.join(map(str, KV_BLOCK_SIZES))}; got {self.block_size}")


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: ``token_ids`` are its new tokens, starting at
    position ``num_computed``; ``block_ids`` cover ``num_computed + len(token_ids)``
    tokens; ``sample`` asks for logits of its last new token. ``pending_src >= 0`` says the
    last new token is not known on the host yet: it is row ``pending_src`` of the previous
    step's sampled tokens, which every rank fills in on the device (``token_ids[-1]`` is a
    placeholder). ``prompt_targets`` (prompt log-probabilities): the prompt tokens that
    follow this chunk's first ``len(prompt_targets)`` tokens, whose log-probabilities under
    those rows' logits the step computes (``StepPlan.prompt_rows``), with ``prompt_top``
    top alternatives each. ``lora_slot``: the LoRA adapter slot its tokens run under
    (``parallel/lora.py``), -1 the base model. ``sample_rows``: with ``sample``, logits
    of that many last new tokens (a speculative draft's: its last token and the draft)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    sample: bool
    pending_src: int = -1
    prompt_targets: tuple[int, ...] = ()
    prompt_top: int = 0
    lora_slot: int = -1
    sample_rows: int = 1


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
    attn_extra: torch.Tensor      # int64 [N]: the attention back-end's own (plan_extra)
    pending_rows: torch.Tensor    # int64 [P]: input_ids rows to fill on the device ...
    pending_src: torch.Tensor     # int64 [P]: ... from these rows of the last sampled tokens
    # prompt log-probabilities: rows whose logits score the next prompt token, and that token
    prompt_rows: torch.Tensor     # int64 [R]
    prompt_targets: torch.Tensor  # int64 [R]
    # each token's LoRA adapter slot (-1: the base model); empty when no token has one
    lora_slots: torch.Tensor      # int64 [T] or [0]
    prompt_top: int = 0           # top alternatives rank 0 keeps per scored row (the most asked)

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, attn: AttentionBackend
              ) -> StepPlan:
        """Chunks must come decodes first (single-token chunks of running sequences), then
        drafted ones (every new token sampled), then the rest; ``attn`` adds what its
        kernels need beyond the common tensors.

        The plan's sequences are what attention sees, one per chunk except that a chunk
        of ``n > 1`` tokens that samples every one (a speculative draft's verification)
        becomes ``n`` single-token sequences over the same blocks, the ``j``-th of length
        ``num_computed + j + 1``: causal attention for each position, served by the decode
        path as a plain decode step of that position would be (the decode kernel splits
        the context over programs; the prefill kernel gives a short query one program a
        head). The scheduler's bound on sampled rows (``max_num_seqs``) bounds them."""
        ids, pos, slots, qsl, lens, sample_idx = [], [], [], [0], [], []
        pend_rows, pend_src, prompt_rows, prompt_targets = [], [], [], []
        # each token's adapter slot, only where some chunk has one (most steps: none)
        lora: list[int] | None = [] if any(c.lora_slot >= 0 for c in chunks) else None
        rows: list[list[int]] = []  # each attention sequence's blocks
        num_decodes = 0
        for c in chunks:
            n = len(c.token_ids)
            verify = n > 1 and c.sample and c.sample_rows == n
            if (n == 1 or verify) and num_decodes == len(lens):
                num_decodes += n
            ids.extend(c.token_ids)
            if lora is not None:
                lora.extend([c.lora_slot] * n)
            p = range(c.num_computed, c.num_computed + n)
            pos.extend(p)
            if len(c.prompt_targets) > n:
                raise ValueError(f"{len(c.prompt_targets)} prompt targets for {n} tokens")
            prompt_rows.extend(range(qsl[-1], qsl[-1] + len(c.prompt_targets)))
            prompt_targets.extend(c.prompt_targets)
            slots.extend(c.block_ids[i // block_size] * block_size + i % block_size for i in p)
            if verify:  # one single-token sequence a position
                qsl.extend(range(qsl[-1] + 1, qsl[-1] + n + 1))
                lens.extend(range(c.num_computed + 1, c.num_computed + n + 1))
                rows.extend([c.block_ids] * n)
            else:
                qsl.append(qsl[-1] + n)
                lens.append(c.num_computed + n)
                rows.append(c.block_ids)
            if c.sample:
                if not 1 <= c.sample_rows <= n:
                    raise ValueError(f"{c.sample_rows} sampled rows of {n} tokens")
                sample_idx.extend(range(qsl[-1] - c.sample_rows, qsl[-1]))
            if c.pending_src >= 0:
                pend_rows.append(qsl[-1] - 1)
                pend_src.append(c.pending_src)
        width = max((len(r) for r in rows), default=1) or 1
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows],
                             dtype=torch.int32).view(len(rows), width)
        query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
        extra = attn.plan_extra(query_lens, num_decodes)
        i64 = torch.int64
        return cls(
            torch.tensor(ids, dtype=i64), torch.tensor(pos, dtype=i64),
            torch.tensor(slots, dtype=i64), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), table,
            torch.tensor(sample_idx, dtype=i64), num_decodes,
            max(query_lens, default=0), max(lens, default=0),
            torch.tensor(extra, dtype=i64), torch.tensor(pend_rows, dtype=i64),
            torch.tensor(pend_src, dtype=i64), torch.tensor(prompt_rows, dtype=i64),
            torch.tensor(prompt_targets, dtype=i64),
            torch.tensor(lora or [], dtype=i64),
            max((c.prompt_top for c in chunks if c.prompt_targets), default=0))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(header, payload)``: the header holds the sizes needed to receive the payload."""
        b, m = self.block_tables.shape
        header = torch.tensor([CMD_STEP, self.num_tokens, b, m, self.logits_indices.shape[0],
                               self.num_decodes, self.max_query_len, self.max_seq_len,
                               self.attn_extra.shape[0], self.pending_rows.shape[0],
                               self.prompt_rows.shape[0], self.prompt_top,
                               self.lora_slots.shape[0]], dtype=torch.int64)
        payload = torch.cat([self.input_ids, self.positions, self.slot_mapping,
                             self.query_start_loc.long(), self.seq_lens.long(),
                             self.block_tables.flatten().long(), self.logits_indices,
                             self.attn_extra, self.pending_rows, self.pending_src,
                             self.prompt_rows, self.prompt_targets, self.lora_slots])
        return header, payload

    @staticmethod
    def payload_sizes(tokens: int, seqs: int, blocks_per_seq: int, sampled: int, extra: int,
                      pending: int, prompt: int, lora: int = 0) -> list[int]:
        """The payload's parts in order (see ``pack``); their sum bounds the receive
        buffer when the arguments are the largest a step can have."""
        t, b = tokens, seqs
        return [t, t, t, b + 1, b, b * blocks_per_seq, sampled, extra, pending, pending,
                prompt, prompt, lora]

    @staticmethod
    def _sizes(header: list[int]) -> list[int]:
        _, t, b, m, s, _, _, _, n, p, r, _, lora = header
        return StepPlan.payload_sizes(t, b, m, s, n, p, r, lora)

    @staticmethod
    def payload_len(header: torch.Tensor) -> int:
        return sum(StepPlan._sizes([int(x) for x in header.tolist()]))

    @classmethod
    def unpack(cls, header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
        h = [int(x) for x in header.tolist()]
        b, m = h[2], h[3]
        nd, mq, ms = h[5:8]
        parts = payload.split(cls._sizes(h))
        return cls(parts[0], parts[1], parts[2], parts[3].int(), parts[4].int(),
                   parts[5].int().view(b, m), parts[6], nd, mq, ms, parts[7],
                   parts[8], parts[9], parts[10], parts[11], parts[12], h[11])

    _TENSORS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                "block_tables", "logits_indices", "attn_extra", "pending_rows",
                "pending_src", "prompt_rows", "prompt_targets", "lora_slots")

    def to(self, device: torch.device) -> StepPlan:
        move = {k: getattr(self, k).to(device, non_blocking=True) for k in self._TENSORS}
        return StepPlan(**move, num_decodes=self.num_decodes,
                        max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                        prompt_top=self.prompt_top)

    def common_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping, self.query_start_loc, self.seq_lens,
                                 self.block_tables, self.num_decodes, self.max_query_len,
                                 self.max_seq_len)

    def metadata(self, attn: AttentionBackend) -> AttentionMetadata:
        """The step's attention metadata as ``attn`` (the back-end it was built for) reads it."""
        return attn.metadata(self.common_metadata(), self.attn_extra)

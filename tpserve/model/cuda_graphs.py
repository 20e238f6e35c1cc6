"""Whole steps replayed from CUDA graphs: pure-decode steps per batch-size bucket, and mixed
steps (decodes plus prefill chunks) per token-count bucket.

A step's inputs are copied into static buffers sized for the largest bucket and padded up
to its bucket; the bucket's graph replays the whole forward (collectives included) plus the
LM head. Steps larger than every bucket run eagerly.

- decode bucket ``B``: every sequence decodes one token and samples it; attention is the
  decode kernel alone over ``B`` rows.
- mixed bucket ``T``: any step of at most ``T`` tokens over every sequence slot; the
  attention back-end's static buffers (``AttentionBackend.graph_state``: for Triton, the
  decode slots and the padded prefill tile table) are filled from the step's metadata and
  give the capture-shaped metadata; logits are taken for ``min(max_num_seqs, T)`` rows.

Sequence parallel (``--tp-comm allgather``): every bucket is a multiple of tp
(``token_multiple``), so a replayed step needs no padding inside the model; a decode bucket
rounded up past ``max_num_seqs`` holds padding sequences (the buffers are sized for it).

Invariants: the graphs are captured after the KV pool exists (its addresses are baked in)
and share one memory pool; padding tokens have token 0, position 0 and slot -1 (no KV
write); padding sequences have no new tokens and context length 0 (attention reads nothing);
rows past the real batch are discarded. Without capture (CPU, tests) the same padded
static-buffer path runs eagerly with the real host-side sizes, so it is tested on CPU
against the plain forward.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.attention.backend import AttentionBackend
from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kv_pool import KVPool
from tpserve.model.plan import StepPlan
from tpserve.parallel.lora import LoraBatch

DECODE, MIXED = "decode", "mixed"


def _round_up(sizes: set[int], multiple: int) -> list[int]:
    return sorted({-(-b // multiple) * multiple for b in sizes})


def buckets_for(max_num_seqs: int, multiple: int = 1) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (always a bucket),
    each rounded up to a multiple of ``multiple`` (sequence parallel: tp), so the largest
    bucket can exceed ``max_num_seqs``."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return _round_up(sizes, multiple)


def mixed_buckets_for(max_tokens: int, multiple: int = 1) -> list[int]:
    """Mixed-step buckets: 16, 32, 64, then every 64 up to ``max_tokens`` (a bucket when
    it is at least 16), each rounded up to a multiple of ``multiple``; none when
    ``max_tokens`` is below 16."""
    if max_tokens < 16:
        return []
    sizes = {b for b in (16, 32, 64) if b < max_tokens}
    sizes.update(range(128, max_tokens, 64))
    sizes.add(max_tokens)
    return _round_up(sizes, multiple)


def graph_reserve_bytes(max_num_seqs: int, max_mixed_tokens: int, vocab_size: int,
                        multiple: int = 1) -> int:
    """What capturing is expected to take, set aside before the KV pool is sized: every
    graph's logits (counted as float32, an upper bound) plus a margin for the graphs'
    activations."""
    rows = sum(buckets_for(max_num_seqs, multiple)) + sum(
        min(max_num_seqs, b) for b in mixed_buckets_for(max_mixed_tokens, multiple))
    return rows * vocab_size * 4 + 512 * 2**20


def _smallest_at_least(buckets: list[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class StepGraphs:
    def __init__(self, model: nn.Module, kv_pool: KVPool, attn: AttentionBackend,
                 max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, max_mixed_tokens: int = 0, token_multiple: int = 1,
                 lora: LoraBatch | None = None):
        self.model = model
        self.lora = lora  # the adapters' per-token slots: graphs are captured with them on
        self.kv_pool = kv_pool
        self.attn = attn
        self.decode_buckets = buckets_for(max_num_seqs, token_multiple)
        self.mixed_buckets = mixed_buckets_for(max_mixed_tokens, token_multiple)
        self.max_num_seqs = max_num_seqs
        # sequence slots of the static buffers: the largest decode bucket may pass
        # max_num_seqs when rounded up to token_multiple
        self.seq_slots = s = self.decode_buckets[-1]
        self.max_model_len = max_model_len
        t = max([s, *self.mixed_buckets])
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(t, dtype=i64, device=device)
        self.positions = torch.zeros(t, dtype=i64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(s, dtype=i32, device=device)
        self.block_tables = torch.zeros((s, max_blocks_per_seq), dtype=i32, device=device)
        self.decode_qsl = torch.arange(s + 1, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(s + 1, dtype=i32, device=device)
        self.logits_indices = torch.zeros(s, dtype=i64, device=device)
        self.attn_state = attn.graph_state(s, self.max_mixed_tokens, device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.captured_bytes = 0
        self.pool_bytes = 0
        self.reserved_delta = 0

    @property
    def max_mixed_tokens(self) -> int:
        return self.mixed_buckets[-1] if self.mixed_buckets else 0

    def select(self, plan: StepPlan) -> tuple[str, int] | None:
        """The graph that can run ``plan``: ``(kind, bucket)``, or None."""
        b = plan.seq_lens.shape[0]
        if b == 0:
            return None
        if plan.num_decodes == b and plan.logits_indices.shape[0] == b:
            bucket = _smallest_at_least(self.decode_buckets, b)
            if bucket is not None:
                return DECODE, bucket
        if b <= self.max_num_seqs:
            bucket = _smallest_at_least(self.mixed_buckets, plan.num_tokens)
            if bucket is not None:
                return MIXED, bucket
        return None

    def can_run(self, plan: StepPlan) -> bool:
        return self.select(plan) is not None

    def _rows(self, kind: str, bucket: int) -> int:
        return bucket if kind == DECODE else min(self.max_num_seqs, bucket)

    def _metadata(self, kind: str, bucket: int, plan: StepPlan | None = None
                  ) -> AttentionMetadata:
        """Capture-shaped metadata; with ``plan`` (eager replay on CPU) the mixed kind
        gets the real sequence count and host sizes the torch reference needs."""
        if kind == DECODE:
            return self.attn.metadata(AttentionMetadata(
                self.slot_mapping[:bucket], self.decode_qsl[: bucket + 1],
                self.seq_lens[:bucket], self.block_tables[:bucket], bucket, 1,
                self.max_model_len))
        slot = self.slot_mapping[:bucket]
        if plan is not None:
            b = plan.seq_lens.shape[0]
            return self.attn.metadata(AttentionMetadata(
                slot, self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b],
                plan.num_decodes, plan.max_query_len, plan.max_seq_len), plan.attn_extra)
        static = AttentionMetadata(slot, self.query_start_loc, self.seq_lens,
                                   self.block_tables, 0, bucket, self.max_model_len)
        return self.attn_state.mixed_metadata(static, bucket)

    def _forward(self, kind: str, bucket: int, plan: StepPlan | None = None) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket],
                            self.kv_pool.layers, self._metadata(kind, bucket, plan))
        if kind == MIXED:
            hidden = hidden[self.logits_indices[: self._rows(kind, bucket)]]
        return self.model.compute_logits(hidden)

    def _fill(self, kind: str, bucket: int, plan: StepPlan) -> None:
        t, b = plan.num_tokens, plan.seq_lens.shape[0]
        m = plan.block_tables.shape[1]
        self.input_ids[:t].copy_(plan.input_ids)
        self.positions[:t].copy_(plan.positions)
        self.slot_mapping[:t].copy_(plan.slot_mapping)
        if self.lora is not None:
            self.lora.set(plan.lora_slots, True)
        self.seq_lens[:b].copy_(plan.seq_lens)
        self.block_tables[:b, :m].copy_(plan.block_tables)
        if bucket > t:
            self.input_ids[t:bucket].zero_()
            self.positions[t:bucket].zero_()
            self.slot_mapping[t:bucket].fill_(-1)
        if kind == DECODE:
            if bucket > b:
                self.seq_lens[b:bucket].zero_()
            return
        s, rows = self.max_num_seqs, plan.logits_indices.shape[0]
        self.seq_lens[b:].zero_()
        self.query_start_loc[: b + 1].copy_(plan.query_start_loc)
        self.query_start_loc[b + 1:].fill_(t)
        self.attn_state.fill(plan.common_metadata(), plan.attn_extra)
        self.logits_indices[:rows].copy_(plan.logits_indices)
        self.logits_indices[rows:s].zero_()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the plan's sampled rows, replayed or run eagerly."""
        kind, bucket = self.select(plan)
        self._fill(kind, bucket, plan)
        rows = plan.logits_indices.shape[0]
        graph = self.graphs.get((kind, bucket))
        if graph is None:
            return self._forward(kind, bucket, plan)[:rows]
        graph.replay()
        return self.outputs[(kind, bucket)][:rows]

    @torch.inference_mode()
    def capture(self) -> int:
        """Captures every bucket (largest first, one shared pool); returns the bytes the
        graphs hold: the caching allocator's segments of their private pool.

        Not a free-memory difference: entering ``torch.cuda.graph`` empties the allocator's
        cache, which gives back more than the capture takes (that reading was 0). The
        cache of the warm-up forwards (on the capture stream, useless afterwards) is
        emptied too, so ``reserved_delta`` (reserved bytes after minus before, both after
        ``empty_cache``) is the pool's cost as well; it cross-checks ``pool_bytes``."""
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        self.slot_mapping.fill_(-1)  # capture must not write into real blocks
        self.seq_lens.zero_()
        self.attn_state.reset()
        self.query_start_loc.zero_()
        if self.lora is not None:
            self.lora.set(None, True)
        keys = ([(MIXED, b) for b in reversed(self.mixed_buckets)]
                + [(DECODE, b) for b in reversed(self.decode_buckets)])
        for key in keys:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward(*key)  # warm-up: Triton compiles, allocator settles
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        self.reserved_delta = torch.cuda.memory_reserved(device) - before
        self.pool_bytes = sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                              if tuple(seg.get("segment_pool_id", ())) == tuple(pool))
        self.captured_bytes = self.pool_bytes or max(self.reserved_delta, 0)
        return self.captured_bytes

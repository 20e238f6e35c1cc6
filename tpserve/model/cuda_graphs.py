"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A step qualifies when every sequence decodes one token and samples it. Its inputs are
copied into static buffers sized for ``max_num_seqs``, padded up to the next bucket, and
the bucket's graph replays the whole forward (collectives included) plus the LM head.

Invariants: the graphs are captured after the KV pool exists (its addresses are baked
in) and share one memory pool; padding rows have token 0, position 0, slot -1 (no KV
write) and context length 0 (attention reads nothing); rows past the real batch are
discarded. Without capture (CPU, ``--enforce-eager``, tests) the same padded static-buffer
path runs eagerly, so it is tested on CPU against the plain forward.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.model.attention.metadata import AttentionMetadata
from tpserve.model.kv_pool import KVPool
from tpserve.model.plan import StepPlan


def buckets_for(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_num_seqs`` (which is always a bucket)."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_pool: KVPool, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.buckets = buckets_for(max_num_seqs)
        self.max_model_len = max_model_len
        n = max_num_seqs
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(n, dtype=i32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.captured_bytes = 0

    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def can_run(self, plan: StepPlan) -> bool:
        b = plan.seq_lens.shape[0]
        return (b > 0 and plan.num_decodes == b and plan.logits_indices.shape[0] == b
                and self.bucket(b) is not None)

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.query_start_loc[: b + 1],
                                 self.seq_lens[:b], self.block_tables[:b], b, 1,
                                 self.max_model_len)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_pool.layers,
                            self._metadata(b))
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a pure-decode step, replayed or run eagerly."""
        b = plan.seq_lens.shape[0]
        bucket = self.bucket(b)
        m = plan.block_tables.shape[1]
        self.input_ids[:b].copy_(plan.input_ids)
        self.positions[:b].copy_(plan.positions)
        self.slot_mapping[:b].copy_(plan.slot_mapping)
        self.seq_lens[:b].copy_(plan.seq_lens)
        self.block_tables[:b, :m].copy_(plan.block_tables)
        if bucket > b:
            self.input_ids[b:bucket].zero_()
            self.positions[b:bucket].zero_()
            self.slot_mapping[b:bucket].fill_(-1)
            self.seq_lens[b:bucket].zero_()
        graph = self.graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:b]
        graph.replay()
        return self.outputs[bucket][:b]

    @torch.inference_mode()
    def capture(self) -> int:
        """Captures every bucket (largest first, one shared pool); returns the bytes the
        graphs hold."""
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        self.slot_mapping.fill_(-1)  # capture must not write into real blocks
        self.seq_lens.zero_()
        for b in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward(b)  # warm-up: Triton compiles, allocator settles
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        # the graphs' private pool and their outputs: free device memory they took
        self.captured_bytes = max(before - torch.cuda.mem_get_info(device)[0], 0)
        return self.captured_bytes

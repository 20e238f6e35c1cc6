"""The start-up memory plan: weights, activation workspace, CUDA graphs and the KV pool,
sized from measured free memory, and the capacity that follows."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_DEFAULT_KV_CAP = 4 * GiB  # like vLLM's CPU default; --kv-cache-memory overrides it


def read_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes: ``cudaMemGetInfo`` on GPU; MemAvailable/MemTotal on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemAvailable"], info["MemTotal"]


def allocator_stats(device: torch.device) -> dict[str, int]:
    """Allocated / reserved bytes and segment count of torch's caching allocator (GPU)."""
    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0, "segments": 0}
    s = torch.cuda.memory_stats(device)
    return {"allocated": s.get("allocated_bytes.all.current", 0),
            "reserved": s.get("reserved_bytes.all.current", 0),
            "segments": s.get("segment.all.current", 0)}


@dataclass(frozen=True)
class MemoryPlan:
    """Where this rank's memory goes. Invariant: ``kv_pool == num_blocks * bytes_per_block``
    and, unless overridden by --kv-cache-memory, ``used_by_others + weights + workspace +
    cuda_graphs + kv_pool <= utilization * total``."""

    device: str
    total: int
    free_at_start: int
    utilization: float
    weights: int
    workspace: int
    workspace_measured: bool
    cuda_graphs: int
    kv_pool: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    kv_source: str
    kv_cache_dtype: str = ""
    kv_scales: str = ""  # FP8 cache only: how its scales were chosen

    @property
    def used_by_others(self) -> int:
        return self.total - self.free_at_start

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_full_sequences(self) -> int:
        return self.kv_tokens // self.max_model_len

    @property
    def free_after(self) -> int:
        return self.free_at_start - self.weights - self.workspace - self.cuda_graphs - self.kv_pool

    def describe(self) -> list[str]:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        how = "measured" if self.workspace_measured else "estimated"
        scales = f", {self.kv_scales}" if self.kv_scales else ""
        return [
            f"memory plan on {self.device}: total {g(self.total)}, free at start "
            f"{g(self.free_at_start)} (other processes hold {g(self.used_by_others)}), "
            f"utilization {self.utilization:.2f}",
            f"  weights {g(self.weights)} | activation workspace {g(self.workspace)} ({how}) | "
            f"CUDA graphs {g(self.cuda_graphs)} | KV pool {g(self.kv_pool)} ({self.kv_source}) "
            f"| free {g(self.free_after)}",
            f"  capacity: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.kv_tokens} tokens of {self.kv_cache_dtype or 'KV'} cache "
            f"({self.bytes_per_block // self.block_size} bytes per token{scales}); "
            f"{self.max_concurrent_full_sequences} concurrent sequences at max length "
            f"{self.max_model_len}",
        ]


def kv_budget(device: torch.device, total: int, free_at_start: int, utilization: float,
              weights: int, workspace: int, cuda_graphs: int,
              kv_cache_memory: int | None) -> tuple[int, str]:
    """Bytes the KV pool may take, and how that was decided."""
    if kv_cache_memory is not None:
        return kv_cache_memory, "--kv-cache-memory"
    if device.type == "cuda":
        used_by_others = total - free_at_start
        budget = int(utilization * total) - used_by_others - weights - workspace - cuda_graphs
        return budget, f"{utilization:.2f} x total - others - weights - workspace - graphs"
    budget = int(utilization * free_at_start) - weights - workspace
    if budget > CPU_DEFAULT_KV_CAP:
        return CPU_DEFAULT_KV_CAP, "CPU default cap (4 GiB; set --kv-cache-memory)"
    return budget, f"{utilization:.2f} x available RAM - weights - workspace"


def estimate_activation_bytes(num_tokens: int, hidden: int, intermediate_per_rank: int,
                              qkv_per_rank: int, vocab: int, num_logit_rows: int,
                              itemsize: int) -> int:
    """Peak activation bytes of one forward (CPU, where no allocator peak is measurable):
    the largest live set is the residual stream, the gate/up output and its product, plus
    the logits of the sampled rows in float32."""
    per_token = (3 * hidden + qkv_per_rank + 3 * intermediate_per_rank) * itemsize
    return num_tokens * per_token + num_logit_rows * vocab * 4 * 2

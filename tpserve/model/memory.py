"""The start-up memory plan: weights, activation workspace, CUDA graphs and the KV pool,
sized from measured free memory, and the capacity that follows."""

from __future__ import annotations

import logging
import pickle
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
    r = read_allocator(device)
    return {"allocated": r.allocated, "reserved": r.reserved, "segments": r.segments}


@dataclass(frozen=True)
class AllocatorReading:
    """One reading of torch's caching allocator on a device (all zeros off CUDA).
    ``reserved`` includes the CUDA graphs' private pool and the KV pool (both are
    allocations of the same allocator); ``num_alloc_retries`` counts the times a
    ``cudaMalloc`` failed and the allocator freed its cache to retry; ``num_ooms`` the
    allocation failures it raised."""

    allocated: int = 0
    reserved: int = 0
    segments: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0

    FIELDS = ("allocated", "reserved", "segments", "num_alloc_retries", "num_ooms")

    @property
    def fragmentation(self) -> float:
        """``(reserved - allocated) / reserved``: the share of reserved memory no tensor
        uses (0 when nothing is reserved)."""
        return (self.reserved - self.allocated) / self.reserved if self.reserved else 0.0

    def as_ints(self) -> list[int]:
        return [int(getattr(self, f)) for f in self.FIELDS]

    @classmethod
    def from_ints(cls, values: list[int]) -> AllocatorReading:
        return cls(*(int(v) for v in values))

    def as_dict(self) -> dict[str, float]:
        return {**{f: getattr(self, f) for f in self.FIELDS},
                "fragmentation": self.fragmentation}


def read_allocator(device: torch.device) -> AllocatorReading:
    """The caching allocator's current figures on ``device`` (host-side; no device sync)."""
    if device.type != "cuda":
        return AllocatorReading()
    s = torch.cuda.memory_stats(device)
    return AllocatorReading(s.get("allocated_bytes.all.current", 0),
                            s.get("reserved_bytes.all.current", 0),
                            s.get("segment.all.current", 0),
                            s.get("num_alloc_retries", 0), s.get("num_ooms", 0))


# the lines of a plan, in the order a report stacks them; together they partition the
# device's total memory (on CPU: the host's RAM)
def start_memory_history(device: torch.device, max_entries: int) -> None:
    """Records the CUDA caching allocator's events on ``device`` from now on (allocations,
    frees, segment maps and unmaps, each with its Python stack; C++ stacks are left out:
    unwinding them costs host time on every allocation), keeping the last ``max_entries``.
    ``allocator_snapshot`` dumps them. CUDA only (the config refuses the flag elsewhere)."""
    with torch.cuda.device(device):  # never a context on another rank's GPU
        torch.cuda.memory._record_memory_history(enabled="all", context="all",
                                                 stacks="python", max_entries=max_entries)


def allocator_snapshot(device: torch.device) -> bytes:
    """The caching allocator's segments and recorded events on ``device`` as the pickle
    https://pytorch.org/memory_viz reads (a dict with ``segments`` and ``device_traces``)."""
    with torch.cuda.device(device):  # the process's devices, one per rank here
        return pickle.dumps(torch.cuda.memory._snapshot())


COMPONENTS = ("weights", "activation_workspace", "cuda_graphs", "kv_pool", "non_torch",
              "other_processes", "free")


@dataclass(frozen=True)
class MemoryPlan:
    """Where this rank's memory goes, every line measured on GPU.

    - ``weights``: the parameters' bytes; ``workspace``: the allocator's peak over the
      profiling forward (CPU: an estimate); ``cuda_graphs``: the allocator's reserved bytes
      the capture added (the graphs' private pool and their warm-up), not a free-memory
      difference; ``graphs_reserve``: what was set aside for them before the KV pool was
      sized; ``kv_pool``: ``num_blocks * bytes_per_block``.
    - ``other_processes``: what NVML names for other processes on the device, else
      ``total - free_at_start`` (then it includes this process's CUDA context);
      ``non_torch``: what this process holds outside the caching allocator after warm-up
      (CUDA context, NCCL and cuBLAS buffers); ``free``: free after warm-up.
    Invariants: ``kv_pool == num_blocks * bytes_per_block``; on GPU the ``COMPONENTS``
    sum to ``total``; unless overridden by --kv-cache-memory, ``others + weights +
    workspace + graphs_reserve + kv_pool <= utilization * total`` at planning time."""

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
    rank: int = 0
    graphs_reserve: int = 0
    other_processes: int = 0
    free: int = 0
    after_warmup: AllocatorReading = AllocatorReading()

    @property
    def used_by_others(self) -> int:
        return self.total - self.free_at_start

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens takes (whole blocks)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrent_full_sequences(self) -> int:
        """Sequences of ``max_model_len`` tokens the pool holds at once, in whole blocks."""
        return self.num_blocks // self.blocks_per_sequence

    @property
    def max_concurrency(self) -> float:
        """vLLM's "Maximum concurrency" (``get_max_concurrency_for_kv_cache_config``):
        ``num_blocks / ceil(max_model_len / block_size)``."""
        return self.num_blocks / self.blocks_per_sequence

    @property
    def held(self) -> int:
        """What the plan says this rank's allocator holds: weights, workspace, graphs and
        the KV pool."""
        return self.weights + self.workspace + self.cuda_graphs + self.kv_pool

    @property
    def non_torch(self) -> int:
        if not self.device.startswith("cuda"):
            return 0
        used = self.total - self.free
        return max(used - self.other_processes - self.after_warmup.reserved, 0)

    @property
    def free_after(self) -> int:
        return self.free

    def components(self) -> dict[str, int]:
        """``COMPONENTS`` -> bytes."""
        return {"weights": self.weights, "activation_workspace": self.workspace,
                "cuda_graphs": self.cuda_graphs, "kv_pool": self.kv_pool,
                "non_torch": self.non_torch, "other_processes": self.other_processes,
                "free": self.free}

    def disagreement(self, reserved: int) -> float | None:
        """``(reserved - held) / held``: how far the allocator's reserved bytes, read once
        serving steps have reserved the workspace, are from the plan (the KV pool and the
        graphs' pool are allocator segments too); None off CUDA (no allocator)."""
        if not self.device.startswith("cuda"):
            return None
        return (reserved - self.held) / self.held

    def describe(self) -> list[str]:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        how = "measured peak" if self.workspace_measured else "estimated"
        scales = f", {self.kv_scales}" if self.kv_scales else ""
        lines = [
            f"memory plan on {self.device} (rank {self.rank}): total {g(self.total)}, free "
            f"at start {g(self.free_at_start)}, utilization {self.utilization:.2f}",
            f"  weights {g(self.weights)} | activation workspace {g(self.workspace)} ({how}) | "
            f"CUDA graphs {g(self.cuda_graphs)} (allocator-measured; "
            f"{g(self.graphs_reserve)} set aside) | KV pool {g(self.kv_pool)} "
            f"({self.kv_source})",
            f"  outside the allocator {g(self.non_torch)} (CUDA context, NCCL) | other "
            f"processes {g(self.other_processes)} | free {g(self.free)}",
        ]
        if self.device.startswith("cuda"):
            a = self.after_warmup
            ready = self.held - self.workspace
            lines.append(
                f"  the allocator reserves {g(a.reserved)} after capture (allocated "
                f"{g(a.allocated)}): weights + graphs + KV pool = {g(ready)} "
                f"({100 * (a.reserved - ready) / ready:+.1f} %); the workspace is reserved "
                "by the first large steps")
        lines.append(
            f"  capacity: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.kv_tokens} tokens of {self.kv_cache_dtype or 'KV'} cache "
            f"({self.bytes_per_block // self.block_size} bytes per token{scales}); "
            f"{self.max_concurrent_full_sequences} concurrent sequences at max length "
            f"{self.max_model_len}")
        # vLLM's two lines, worded as vLLM logs them
        lines.append(f"  KV cache size: {self.kv_tokens:,} tokens")
        lines.append(f"  Maximum concurrency for {self.max_model_len:,} tokens per request: "
                     f"{self.max_concurrency:.2f}x")
        return lines

    def as_ints(self) -> list[int]:
        """``COMPONENTS``, then ``total``, ``held``, ``num_blocks``: what ranks gather."""
        return [*self.components().values(), self.total, self.held, self.num_blocks]


def plan_from_ints(values: list[int]) -> dict[str, int]:
    """A gathered ``MemoryPlan.as_ints`` as a dict."""
    return dict(zip((*COMPONENTS, "total", "held", "num_blocks"), (int(v) for v in values), strict=False))


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


def check_blocks_override(blocks: int, planned: int, how: str, need: int, block_size: int,
                          max_model_len: int) -> str | None:
    """``--num-gpu-blocks-override``: ValueError where ``blocks`` cannot hold one sequence
    of ``max_model_len`` (``need`` blocks); a warning to log where they exceed the
    ``planned`` blocks (the plan's budget, decided by ``how``), else None. As in vLLM, the
    pool is allocated either way, and a device may then run out of memory."""
    if blocks < need:
        raise ValueError(
            f"--num-gpu-blocks-override {blocks}: {blocks} blocks of {block_size} tokens "
            f"hold {blocks * block_size} tokens, but one sequence of --max-model-len "
            f"{max_model_len} needs {need} blocks; give at least {need} or a smaller "
            "--max-model-len")
    if blocks > planned:
        return (f"--num-gpu-blocks-override {blocks} exceeds the {max(planned, 0)} blocks "
                f"the memory plan leaves for the KV pool ({how}): it may not fit")
    return None


def estimate_activation_bytes(num_tokens: int, hidden: int, mlp_columns: int,
                              qkv_per_rank: int, vocab: int, num_logit_rows: int,
                              itemsize: int) -> int:
    """Peak activation bytes of one forward (CPU, where no allocator peak is measurable):
    the largest live set is the residual stream, the MLP's live activations
    (``ModelConfig.mlp_activation_columns``: a dense MLP's gate/up output and its product),
    plus the logits of the sampled rows in float32."""
    per_token = (3 * hidden + qkv_per_rank + mlp_columns) * itemsize
    return num_tokens * per_token + num_logit_rows * vocab * 4 * 2

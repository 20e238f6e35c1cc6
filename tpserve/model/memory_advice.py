"""Why the model does not fit, and which flag would make it fit by how much.

``suggest_fits`` is a pure function of the planning numbers (``FitInputs``): for each flag
it re-runs the plan's own arithmetic (``kv_budget``) with that one flag changed and keeps
the changes that would give the KV pool at least one full sequence. ``explain_no_fit``
turns the numbers, the other processes on the device and the suggestions into the
message a refused start-up (or a logged out-of-memory step) shows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from tpserve.model.config import ModelConfig
from tpserve.model.cuda_graphs import graph_reserve_bytes
from tpserve.model.gpu_processes import GpuProcesses
from tpserve.model.kv_cache_dtype import KV_CACHE_DTYPE_NAMES, KV_CACHE_DTYPES
from tpserve.model.kv_pool import kv_bytes_per_block
from tpserve.model.memory import CPU_DEFAULT_KV_CAP, AllocatorReading, GiB, MemoryPlan, kv_budget
from tpserve.model.plan import StepLimits

MiB = 1 << 20


@dataclass(frozen=True)
class FitInputs:
    """The numbers of one rank's plan. ``tp_options``: ``(tp, weights per rank, bytes
    per KV block per rank)`` for larger tensor-parallel sizes; ``seq_options``:
    ``(max_num_seqs, bytes the workspace and graphs would shrink by)`` for smaller
    ``--max-num-seqs``; ``smaller_kv_dtypes``: ``(name, itemsize)`` of KV cache dtypes
    smaller than the current one; ``stored_weights``: this rank's weights if a GGUF file
    served dequantized held its blocks as stored (``--quantization gguf``; None: not such a
    file); ``offloadable``: the most bytes of weights ``--cpu-offload-gb`` could take off
    this rank's device (0: none, or offloading is on already)."""

    device_type: str
    total: int
    free_at_start: int
    utilization: float
    kv_cache_memory: int | None
    weights: int
    workspace: int
    cuda_graphs: int
    bytes_per_block: int
    block_size: int
    max_model_len: int
    kv_itemsize: int
    max_num_seqs: int
    tp: int
    smaller_kv_dtypes: tuple[tuple[str, int], ...] = ()
    tp_options: tuple[tuple[int, int, int], ...] = ()
    seq_options: tuple[tuple[int, int], ...] = ()
    stored_weights: int | None = None
    offloadable: int = 0

    def budget(self, weights: int | None = None, workspace: int | None = None,
               cuda_graphs: int | None = None, utilization: float | None = None,
               kv_cache_memory: int | None = -1) -> int:
        """``kv_budget`` with some inputs changed (``kv_cache_memory=-1``: unchanged)."""
        return kv_budget(torch.device(self.device_type), self.total, self.free_at_start,
                         self.utilization if utilization is None else utilization,
                         self.weights if weights is None else weights,
                         self.workspace if workspace is None else workspace,
                         self.cuda_graphs if cuda_graphs is None else cuda_graphs,
                         self.kv_cache_memory if kv_cache_memory == -1 else kv_cache_memory
                         )[0]

    @property
    def blocks_needed(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def kv_needed(self) -> int:
        """KV bytes one sequence of ``max_model_len`` tokens needs."""
        return self.blocks_needed * self.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return max(self.budget(), 0) // self.bytes_per_block


@dataclass(frozen=True)
class Suggestion:
    flag: str
    value: str
    effect: str

    def describe(self) -> str:
        return f"{self.flag} {self.value}: {self.effect}"


def _gib(b: int) -> str:
    """Bytes in GiB from 1 GiB up, else MiB, else KiB (small models stay readable)."""
    if abs(b) >= GiB:
        return f"{b / GiB:.2f} GiB"
    return f"{b / MiB:.2f} MiB" if abs(b) >= MiB else f"{b / 1024:.1f} KiB"


def _utilization_for(f: FitInputs) -> float | None:
    """The smallest utilization (in steps of 0.01) whose budget holds one sequence."""
    base = f.total if f.device_type == "cuda" else f.free_at_start
    if base <= 0:
        return None
    u = math.ceil(100 * (f.kv_needed - f.budget(utilization=0.0)) / base) / 100
    u = max(u, 0.01)
    while u <= 1.0 and f.budget(utilization=u) < f.kv_needed:
        u = round(u + 0.01, 2)
    return u if u <= 1.0 else None


def smaller_kv_dtypes(kv_dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """KV cache dtypes smaller than ``kv_dtype``, largest first: ``(name, itemsize)``."""
    sizes = {name: KV_CACHE_DTYPES[name].itemsize for name in KV_CACHE_DTYPE_NAMES}
    smaller = [(n, s) for n, s in sizes.items() if s < kv_dtype.itemsize]
    return tuple(sorted(smaller, key=lambda ns: -ns[1]))


def tp_options(m: ModelConfig, tp: int, block_size: int, kv_dtype: torch.dtype,
               weights: int) -> tuple[tuple[int, int, int], ...]:
    """``(tp, weights per rank, KV bytes per block per rank)`` for tp up to 8 above ``tp``
    (weights scale as 1/tp: the replicated norms are negligible)."""
    return tuple((t, weights * tp // t, kv_bytes_per_block(
        m.num_hidden_layers, block_size, m.kv_heads_for(t), m.head_dim, kv_dtype))
        for t in (2, 4, 8) if t > tp)


def seq_options(lim: StepLimits, vocab: int, use_graphs: bool, max_mixed: int,
                multiple: int) -> tuple[tuple[int, int], ...]:
    """``(max_num_seqs, bytes saved)`` for halvings of --max-num-seqs: the graphs' reserve
    shrinks exactly; the profiled logits (float32, twice) by estimate."""
    rows = min(lim.max_num_seqs, lim.max_num_batched_tokens)

    def graphs(s: int) -> int:
        return graph_reserve_bytes(s, max_mixed, vocab, multiple) if use_graphs else 0

    out, s = [], lim.max_num_seqs // 2
    while s >= 1:
        saved = (graphs(lim.max_num_seqs) - graphs(s)
                 + (rows - min(s, lim.max_num_batched_tokens)) * vocab * 4 * 2)
        out.append((s, saved))
        s //= 2
    return tuple(out)


def suggest_fits(f: FitInputs) -> list[Suggestion]:
    """The single-flag changes that make one full sequence fit, each with what it gives
    (KV blocks and tokens), in the order: --max-model-len, --gpu-memory-utilization or
    --kv-cache-memory, --max-num-seqs, --kv-cache-dtype, --quantization gguf (a GGUF file
    served dequantized), --tensor-parallel-size."""
    out: list[Suggestion] = []
    need = f.blocks_needed
    blocks = f.num_blocks
    if blocks >= 1:
        tokens = blocks * f.block_size
        out.append(Suggestion("--max-model-len", str(tokens),
                              f"the KV pool's {blocks} blocks hold one sequence of "
                              f"{tokens} tokens"))
    cpu_capped = f.device_type != "cuda" and f.kv_needed > CPU_DEFAULT_KV_CAP
    if f.kv_cache_memory is None and not cpu_capped:
        u = _utilization_for(f)
        if u is not None:
            b = f.budget(utilization=u) // f.bytes_per_block
            of = "device memory" if f.device_type == "cuda" else "available RAM"
            out.append(Suggestion("--gpu-memory-utilization", f"{u:.2f}",
                                  f"{b} blocks = {b * f.block_size} tokens of {of}"))
    # a size that holds one sequence, where free memory has room for it (on CPU also when
    # the utilization was the limit: the flag is how CPU users size the pool, as in vLLM)
    if f.kv_cache_memory is not None or f.device_type != "cuda":
        mib = math.ceil(f.kv_needed / MiB)
        if f.device_type == "cuda":
            room = f.free_at_start - f.weights - f.workspace - f.cuda_graphs
        else:
            room = f.free_at_start - f.weights - f.workspace
        if mib * MiB <= room:
            b = (mib * MiB) // f.bytes_per_block
            out.append(Suggestion("--kv-cache-memory", f"{mib}MiB",
                                  f"{b} blocks = {b * f.block_size} tokens"))
    if f.kv_cache_memory is None:
        for seqs, saved in sorted(f.seq_options, reverse=True):
            if seqs >= f.max_num_seqs:
                continue
            b = max(f.budget(workspace=f.workspace - saved), 0) // f.bytes_per_block
            if b >= need:
                out.append(Suggestion("--max-num-seqs", str(seqs),
                                      f"workspace and graphs {_gib(saved)} smaller: {b} "
                                      f"blocks = {b * f.block_size} tokens"))
                break
    for name, itemsize in f.smaller_kv_dtypes:
        per_block = f.bytes_per_block * itemsize // f.kv_itemsize
        b = max(f.budget(), 0) // per_block
        if b >= need:
            out.append(Suggestion("--kv-cache-dtype", name,
                                  f"blocks of {per_block} bytes instead of "
                                  f"{f.bytes_per_block}: {b} blocks = {b * f.block_size} "
                                  "tokens"))
            break
    if f.stored_weights is not None and f.kv_cache_memory is None:
        b = max(f.budget(weights=f.stored_weights), 0) // f.bytes_per_block
        if b >= need:
            out.append(Suggestion("--quantization", "gguf",
                                  f"the GGUF file's blocks as stored, about "
                                  f"{_gib(f.stored_weights)} of weights per GPU instead of "
                                  f"{_gib(f.weights)}: {b} blocks = {b * f.block_size} "
                                  "tokens"))
    for tp, weights, per_block in sorted(f.tp_options):
        if tp <= f.tp:
            continue
        b = max(f.budget(weights=weights), 0) // per_block
        if b >= need:
            out.append(Suggestion("--tensor-parallel-size", str(tp),
                                  f"{_gib(weights)} of weights per GPU: {b} blocks = "
                                  f"{b * f.block_size} tokens per rank (needs {tp} GPUs)"))
            break
    if f.offloadable and f.kv_cache_memory is None and f.device_type == "cuda":
        short = f.kv_needed - f.budget()  # a negative budget: the weights crowd it out
        gib = math.ceil(10 * short / GiB) / 10  # to 0.1 GiB, up
        if 0 < gib * GiB <= f.offloadable:
            b = max(f.budget(weights=f.weights - int(gib * GiB)), 0) // f.bytes_per_block
            if b >= need:
                out.append(Suggestion("--cpu-offload-gb", f"{gib:g}",
                                      f"{gib:g} GiB of weights streamed from host memory "
                                      f"(each step slower by their copy): {b} blocks = "
                                      f"{b * f.block_size} tokens"))
    return out


def explain_no_fit(f: FitInputs, others: GpuProcesses, device: str, rank: int) -> str:
    """The refusal: what was asked for, what was free, what this server holds by
    component, the other processes on the device, and the flags that would make it fit."""
    budget = f.budget()
    lines = [
        f"the model does not fit on {device} (rank {rank}): weights {_gib(f.weights)} + "
        f"workspace {_gib(f.workspace)} leave {_gib(max(budget, 0))} for the KV pool "
        f"= {f.num_blocks} blocks of {f.block_size} tokens, but one sequence of "
        f"--max-model-len {f.max_model_len} needs {f.blocks_needed} blocks "
        f"({_gib(f.kv_needed)})",
        f"  asked for: KV pool {_gib(f.kv_needed)} at least, "
        + (f"--kv-cache-memory {_gib(f.kv_cache_memory)}" if f.kv_cache_memory
           is not None else f"--gpu-memory-utilization {f.utilization:.2f} of "
           + (f"{_gib(f.total)}" if f.device_type == "cuda"
              else f"{_gib(f.free_at_start)} available RAM at start")),
        f"  free at start: {_gib(f.free_at_start)} of {_gib(f.total)}",
        f"  this server holds: weights {_gib(f.weights)} | activation workspace "
        f"{_gib(f.workspace)} | CUDA graphs (set aside) {_gib(f.cuda_graphs)}",
    ]
    if others.processes:
        lines.append(_others_line(others, device))
    elif f.device_type == "cuda":
        lines.append(f"  other processes hold {_gib(f.total - f.free_at_start)} "
                     f"(not named: {others.source})")
    fixes = suggest_fits(f)
    if fixes:
        lines.append("  any one of these would make it fit:")
        lines += [f"    {s.describe()}" for s in fixes]
    else:
        lines.append("  no single flag makes it fit: free memory (stop other processes) "
                     "or use more GPUs")
    return "\n".join(lines)


_ASKED = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


_ASKED_CPU = re.compile(r"tried to allocate ([0-9]+) bytes")


def asked_bytes(message: str) -> int | None:
    """The request size in a caching-allocator OOM message ("Tried to allocate 2.00 GiB")
    or the CPU allocator's ("you tried to allocate 4294967296 bytes")."""
    m = _ASKED.search(message)
    if m is not None:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    m = _ASKED_CPU.search(message)
    return None if m is None else int(m.group(1))


def allocation_failed(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's out-of-memory: CUDA's ``torch.OutOfMemoryError``,
    or the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def pool_flag(how: str, utilization: float) -> str:
    """The flag that sized the KV pool, from the plan's ``how`` (``kv_budget``, or the
    override's): ``--num-gpu-blocks-override N``, ``--kv-cache-memory`` (also the CPU
    default cap it replaces) or ``--gpu-memory-utilization U``."""
    if how.startswith("--num-gpu-blocks-override"):
        return how
    if how == "--kv-cache-memory":
        return how
    if how.startswith("CPU default cap"):
        return "the CPU default cap of 4 GiB, which --kv-cache-memory overrides"
    return f"--gpu-memory-utilization {utilization:.2f}"


def explain_pool_oom(f: FitInputs, flag: str, num_blocks: int, message: str, free: int,
                     device: str, rank: int, others: GpuProcesses) -> str:
    """The KV pool of ``num_blocks`` blocks, sized by ``flag``, could not be allocated
    (``message``: the allocator's error; ``free``: free memory read after it failed): the
    bytes asked, the free memory, and the sizes that would fit in it."""
    asked = num_blocks * f.bytes_per_block
    first = message.strip().splitlines()[0] if message.strip() else "out of memory"
    graphs = (f" | CUDA graphs (set aside) {_gib(f.cuda_graphs)}"
              if f.device_type == "cuda" else "")
    lines = [
        f"the model does not fit on {device} (rank {rank}): the KV pool of {num_blocks} "
        f"blocks of {f.block_size} tokens = {_gib(asked)} ({flag}) could not be allocated, "
        f"{_gib(free)} free",
        f"  the allocator: {first}",
        f"  free at start: {_gib(f.free_at_start)} of {_gib(f.total)}; this server holds: "
        f"weights {_gib(f.weights)} | activation workspace {_gib(f.workspace)}{graphs}",
    ]
    if others.processes:
        lines.append(_others_line(others, device))
    # what is free now, less a tenth for the steps' own allocations
    blocks = int(0.9 * free) // f.bytes_per_block
    if blocks >= num_blocks:  # free memory holds it: a limit refused it, not the device
        lines.append("  free memory would hold it: a limit on this process refused it (ulimit "
                     "-v, a cgroup, the kernel's overcommit policy); raise the limit or ask "
                     "for a smaller pool")
    elif blocks >= f.blocks_needed:
        mib = blocks * f.bytes_per_block // MiB
        fixes = [f"--kv-cache-memory {mib}MiB ({blocks} blocks = {blocks * f.block_size} "
                 "tokens)", f"--num-gpu-blocks-override {blocks}"]
        if f.device_type == "cuda" and flag.startswith("--gpu-memory-utilization") \
                and f.total:
            u = math.floor(100 * (f.utilization - (asked - blocks * f.bytes_per_block)
                                  / f.total)) / 100
            if u > 0:
                fixes.append(f"--gpu-memory-utilization {u:.2f}")
        lines.append("  a smaller pool fits in what is free: " + "; or ".join(fixes))
    else:
        lines.append(f"  what is free holds no sequence of --max-model-len {f.max_model_len} "
                     f"({f.blocks_needed} blocks, {_gib(f.kv_needed)}): free memory (stop "
                     "other processes), or lower --max-model-len, or use more GPUs")
    return "\n".join(lines)


def explain_oom(message: str, plan: MemoryPlan, now: AllocatorReading, free: int,
                others: GpuProcesses, max_num_batched_tokens: int) -> str:
    """A step ran out of memory: what it asked for, what was free, the plan's components
    next to the allocator now, other processes on the device, and the flags that leave
    more room for a step."""
    asked = asked_bytes(message)
    first = message.strip().splitlines()[0] if message.strip() else "out of memory"
    lines = [
        f"a step ran out of memory on {plan.device} (rank {plan.rank}): {first}",
        f"  asked for {'?' if asked is None else _gib(asked)}, free on the device "
        f"{_gib(free)} of {_gib(plan.total)}",
        "  this server holds: " + " | ".join(
            f"{k.replace('_', ' ')} {_gib(v)}" for k, v in plan.components().items()
            if k not in ("other_processes", "free")),
        f"  allocator now: reserved {_gib(now.reserved)}, allocated {_gib(now.allocated)}, "
        f"fragmentation {100 * now.fragmentation:.1f} %, {now.num_alloc_retries} alloc "
        f"retries, {now.num_ooms} OOMs",
    ]
    if others.processes:
        lines.append(f"  other processes on {plan.device} hold {_gib(others.used_bytes)}: "
                     + "; ".join(p.describe() for p in others.processes))
    else:
        lines.append(f"  other processes: none named ({others.source})")
    short = max((asked or 0) - free, 0)
    fixes = [f"--max-num-batched-tokens {max(max_num_batched_tokens // 2, 1)} (half the "
             "activation workspace of the largest step)"]
    if plan.device.startswith("cuda") and plan.total:
        u = math.floor(100 * (plan.utilization - max(short, 1 << 30) / plan.total)) / 100
        if u > 0:
            fixes.insert(0, f"--gpu-memory-utilization {u:.2f} (the KV pool leaves "
                            f"{_gib(max(short, 1 << 30))} more headroom)")
    lines.append("  to leave steps more room: " + "; or ".join(fixes))
    return "\n".join(lines)


def explain_start_oom(stage: str, message: str, device: str, rank: int, free_at_start: int,
                      total: int, others: GpuProcesses) -> str:
    """Start-up ran out of device memory before a plan existed (the weights or the
    profiling step): what it asked for, what was free, who else holds the device."""
    asked = asked_bytes(message)
    lines = [f"the model does not fit on {device} (rank {rank}): {stage} ran out of memory "
             f"(asked for {'?' if asked is None else _gib(asked)})",
             f"  free at start: {_gib(free_at_start)} of {_gib(total)}"]
    if others.processes:
        lines.append(_others_line(others, device))
    else:
        lines.append(f"  other processes hold {_gib(total - free_at_start)} (not named: "
                     f"{others.source})")
    if device.startswith("cuda"):
        lines.append("  to make it fit: free the device (stop the processes above), or split "
                     "the weights over more GPUs (--tensor-parallel-size), or hold part of "
                     "them in host memory (--cpu-offload-gb), or lower "
                     "--max-num-batched-tokens (the profiled step)")
    else:  # host RAM: no other device to split over or offload to
        lines.append("  to make it fit: free host memory (stop other processes), or serve a "
                     "smaller model or quantized weights, or lower --max-num-batched-tokens "
                     "(the profiled step)")
    return "\n".join(lines)


def _others_line(others: GpuProcesses, device: str) -> str:
    """The line naming the other processes on ``device`` and what they hold."""
    return (f"  other processes on {device} hold {_gib(others.used_bytes)}: "
            + "; ".join(p.describe() for p in others.processes))

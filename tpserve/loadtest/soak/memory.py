"""The server's memory, read from outside: every process of its tree (the root pid given
with ``--server-pid`` and all its descendants: the HTTP process, the engine process, the
tensor-parallel workers), and GPU memory where NVML can attribute it to those processes.

Linux only (``/proc``). A process's name is its ``/proc/<pid>/comm`` (tpserve names its
engine process ``tpserve-engine`` and its workers ``tpserve-rankN``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MiB = 2**20


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    name: str
    rss_mib: float


@dataclass(frozen=True)
class TreeMemory:
    """One reading of the tree. ``gpu_mib`` maps pid -> device memory used (None when not
    measured; ``gpu_note`` says why)."""

    processes: tuple[ProcessMemory, ...]
    gpu_mib: dict[int, float] | None
    gpu_note: str

    @property
    def rss_mib(self) -> float:
        return sum(p.rss_mib for p in self.processes)


def read_rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` from /proc/<pid>/status, in MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                value, unit = line.split()[1:3]
                if unit.lower() != "kb":
                    raise ValueError(f"unexpected VmRSS unit {unit!r}")
                return int(value) / 1024
    raise ValueError(f"no VmRSS line in /proc/{pid}/status")


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants, breadth first (parents from /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        order.append(pid)
        queue.extend(sorted(children.get(pid, [])))
    return order


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
        return f.read().strip()


def read_gpu_mib(pids: set[int]) -> tuple[dict[int, float] | None, str]:
    """Device memory used by each of ``pids`` (all GPUs) through NVML, or None and why not."""
    try:
        import pynvml
    except ImportError:
        return None, "not measured: NVML bindings (nvidia-ml-py) are not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"not measured: NVML is not available ({e})"
    try:
        used: dict[int, float] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    used[proc.pid] = used.get(proc.pid, 0.0) + proc.usedGpuMemory / MiB
        return used, "NVML, per process"
    except pynvml.NVMLError as e:
        return None, f"not measured: NVML query failed ({e})"
    finally:
        pynvml.nvmlShutdown()


def read_tree(root: int) -> TreeMemory:
    """RSS of every process of ``root``'s tree (processes that end meanwhile are skipped;
    the root itself must be readable: OSError/ValueError otherwise), and GPU memory."""
    processes = [ProcessMemory(root, _name(root), read_rss_mib(root))]
    for pid in tree_pids(root)[1:]:
        try:
            processes.append(ProcessMemory(pid, _name(pid), read_rss_mib(pid)))
        except (OSError, ValueError):
            continue
    gpu, note = read_gpu_mib({p.pid for p in processes})
    return TreeMemory(tuple(processes), gpu, note)


def compare(root: int, before: TreeMemory, after: TreeMemory, limit_mib: float
            ) -> dict[str, Any]:
    """The ``rss`` section of the result: totals, per process (processes that started or
    ended in between count from or to 0), the one that grew most, and GPU memory (reported,
    not checked). ``ok`` when the tree's total RSS grew by less than ``limit_mib``."""
    old = {p.pid: p for p in before.processes}
    new = {p.pid: p for p in after.processes}
    rows = []
    for pid in [*new, *(pid for pid in old if pid not in new)]:
        b, a = old.get(pid), new.get(pid)
        rows.append({
            "pid": pid, "name": (a or b).name, "root": pid == root,
            "baseline_mib": None if b is None else round(b.rss_mib, 1),
            "after_mib": None if a is None else round(a.rss_mib, 1),
            "growth_mib": round((a.rss_mib if a else 0.0) - (b.rss_mib if b else 0.0), 1),
        })
    growth = after.rss_mib - before.rss_mib
    largest = max(rows, key=lambda r: r["growth_mib"])
    if before.gpu_mib is None or after.gpu_mib is None:
        gpu: dict[str, Any] = {"measured": False,
                               "note": after.gpu_note if after.gpu_mib is None
                               else before.gpu_note}
    else:
        gpu = {"measured": True, "note": after.gpu_note,
               "baseline_mib": round(sum(before.gpu_mib.values()), 1),
               "after_mib": round(sum(after.gpu_mib.values()), 1),
               "growth_mib": round(sum(after.gpu_mib.values())
                                   - sum(before.gpu_mib.values()), 1),
               "processes": {str(pid): round(v, 1) for pid, v in after.gpu_mib.items()}}
    return {"pid": root, "baseline_mib": round(before.rss_mib, 1),
            "after_mib": round(after.rss_mib, 1), "growth_mib": round(growth, 1),
            "limit_mib": limit_mib, "ok": growth < limit_mib, "processes": rows,
            "largest_growth": {k: largest[k] for k in ("pid", "name", "growth_mib")},
            "gpu": gpu}

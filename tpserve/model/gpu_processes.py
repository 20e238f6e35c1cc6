"""Who else holds memory on this rank's GPU: the processes NVML lists on the device, with
their memory, this process excluded. Optional: without the NVML bindings (``nvidia-ml-py``,
the ``gpu`` extra), off CUDA, or where NVML cannot see other processes (a container's PID
namespace), the answer is empty and says why."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}) {self.used_bytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class GpuProcesses:
    """Other processes on one GPU; ``source`` says how they were found (or why not)."""

    processes: tuple[GpuProcess, ...]
    source: str

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes for p in self.processes)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return " ".join(a.decode(errors="replace") for a in argv[:3] if a) or "?"
    except OSError:
        return "?"  # another PID namespace, or gone


def other_gpu_processes(device: torch.device) -> GpuProcesses:
    """Processes other than this one using ``device``, through NVML (matched by the
    device's UUID, so ``CUDA_VISIBLE_DEVICES`` does not matter)."""
    if device.type != "cuda":
        return GpuProcesses((), "not a CUDA device")
    try:
        import pynvml
    except ImportError:
        return GpuProcesses((), "NVML bindings (nvidia-ml-py) not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return GpuProcesses((), f"NVML unavailable ({e})")
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        found: dict[int, int] = {}
        for query in (pynvml.nvmlDeviceGetComputeRunningProcesses,
                      pynvml.nvmlDeviceGetGraphicsRunningProcesses):
            for proc in query(handle):
                if proc.pid != os.getpid() and proc.usedGpuMemory is not None:
                    found[proc.pid] = max(found.get(proc.pid, 0), int(proc.usedGpuMemory))
        procs = tuple(GpuProcess(pid, _process_name(pid), used)
                      for pid, used in sorted(found.items()))
        return GpuProcesses(procs, "NVML")
    except pynvml.NVMLError as e:
        return GpuProcesses((), f"NVML query failed ({e})")
    finally:
        pynvml.nvmlShutdown()

"""Measurement helpers shared by the benchmark scripts (torch only, no tpserve import, so
``bench_hf.py`` can use them on a machine without tpserve's dependencies)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of ``fn()``: CUDA events on GPU, the host clock on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_limits(device: torch.device, copy_mib: int, n: int) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate on random data."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    numel = copy_mib * 2**20 // 2
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = time_op(lambda: dst.copy_(src), device, reps=20)
    copy_gbps = 2 * src.numel() * src.element_size() / t / 1e9
    # two operand sets, alternated, so repeated products do not run from the cache
    sets = [(torch.randn(n, n, dtype=dtype, device=device),
             torch.randn(n, n, dtype=dtype, device=device)) for _ in range(2)]
    out = torch.empty(n, n, dtype=dtype, device=device)
    i = [0]

    def mm():
        a, b = sets[i[0] % 2]
        i[0] += 1
        torch.matmul(a, b, out=out)

    t = time_op(mm, device, warmup=5, reps=20)
    tflops = 2 * n**3 / t / 1e12
    return {"copy_GBps": round(copy_gbps, 2), "bf16_tflops": round(tflops, 3),
            "copy_bytes": 2 * numel * 2, "matmul_n": n,
            "matmul_dtype": str(dtype).replace("torch.", ""),
            **host_limits(device)}


def host_limits(device: torch.device, ops: int = 5000) -> dict[str, float | str]:
    """The host side, which bounds every eager step: the CPU's model name and the host time
    per launch of a tiny op (``torch.add`` into a preallocated output, 4 elements: the
    device finishes each long before the next is issued, so the time is Python + torch's
    dispatch + the launch)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), name)
    except OSError:
        pass
    a = torch.zeros(4, device=device)
    out = torch.empty_like(a)
    for _ in range(200):
        torch.add(a, 1.0, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(ops):
        torch.add(a, 1.0, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"host_cpu": name, "host_cpus": os.cpu_count() or 0,
            "launch_us": round((time.perf_counter() - t0) / ops * 1e6, 3)}


def git_commit(arg: str | None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)``: the argument, else $TPSERVE_GIT_COMMIT, else git here."""
    if arg:
        return arg, None
    if os.environ.get("TPSERVE_GIT_COMMIT"):
        return os.environ["TPSERVE_GIT_COMMIT"], None
    try:
        root = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root,
                                    capture_output=True, text=True).stdout.strip())
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, None

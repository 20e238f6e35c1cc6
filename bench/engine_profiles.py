"""torch.profiler looks at ``bench_engine.py``'s workloads: pure-decode and mixed steps,
and the serving workload's steady state (GPU time by kernel category); run through
``bench_engine.py``."""

from __future__ import annotations

import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_sections import (  # noqa: E402  (bench/engine_sections.py)
    Tracker,
    random_prompt,
    run_closed_loop,
    step_token_histogram,
)
from measure import sync  # noqa: E402  (bench/measure.py)

from tpserve.model.sampling_params import SamplingParams  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.request_state import RequestState  # noqa: E402

# kernel name pattern -> where its time goes, first match wins (names of this project's
# Triton kernels, cuBLAS/cuBLASLt GEMMs (nvjet, sm90 xmma, cutlass), torch's elementwise)
KERNEL_CATEGORIES = (
    ("attention_decode", r"_decode_(split|reduce)_kernel"),
    ("attention_prefill", r"_prefill_kernel"),
    ("quantize", r"_quant"),
    ("rope_kv_write", r"rope"),
    ("norm", r"rms_norm"),
    ("activation", r"silu"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|_wo_|_w8a8|scaled_mm|splitKreduce"),
    ("memcpy_memset", r"^Memcpy|^Memset"),
)


def kernel_category(name: str) -> str:
    for cat, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def by_category(times) -> dict[str, float]:
    """``(kernel name, microseconds)`` pairs summed by ``kernel_category``."""
    sums: dict[str, float] = {}
    for name, us in times:
        cat = kernel_category(name)
        sums[cat] = sums.get(cat, 0.0) + us
    return sums


# idle stretches by length (us): kernel boundaries in a graph replay ... waits for the host
GAP_BOUNDS_US = (2.0, 5.0, 20.0, 100.0)


def busy_and_gaps(kernels) -> tuple[float, dict[str, float]]:
    """The union of the kernels' time ranges (us; kernels on two streams overlap) and the
    idle time between them, summed by the length of each idle stretch (``GAP_BOUNDS_US``:
    the short ones are kernel boundaries inside a graph replay, the long ones the GPU
    waiting for the host)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    names = [f"<{b:g}us" for b in GAP_BOUNDS_US] + [f">={GAP_BOUNDS_US[-1]:g}us"]
    gaps = dict.fromkeys(names, 0.0)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            if end is not None:
                gap = a - end
                i = next((i for i, bound in enumerate(GAP_BOUNDS_US) if gap < bound),
                         len(GAP_BOUNDS_US))
                gaps[names[i]] += gap
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy, gaps


def profile_serving(core: EngineCore, rng: random.Random, vocab: int, a,
                    device: torch.device, table_path: Path, window: int) -> dict[str, Any]:
    """The serving workload's steady state under torch.profiler (CUDA activity only): a
    closed loop of ``3 * concurrency`` prompts, of which ``window`` steps are profiled,
    starting once the first requests have finished (by then admissions follow
    completions; the prefill bursts and decode stretches of the run alternate, so a
    window of a few hundred steps holds both). Reports per step: wall time, GPU kernel
    time by category (``KERNEL_CATEGORIES``), the GPU's busy time (the union of its
    kernels) and idle time by stretch length (``busy_and_gaps``), the GPU's busy fraction
    (kernel time over wall time: the rest is the GPU waiting for the host), tokens and
    output tokens; and writes the top kernels to ``table_path``."""
    prompts = [random_prompt(rng, a.input_len, vocab) for _ in range(3 * a.concurrency)]
    sc = core.scheduler.config
    budget = sc.max_mixed_tokens or sc.max_num_batched_tokens
    start = a.output_len + -(-a.concurrency * a.input_len // budget) + 2
    # CUDA activity alone on a GPU: tracing every host op would slow the host several
    # times over and leave the GPU idle between steps, which is one of the figures here
    acts = [torch.profiler.ProfilerActivity.CUDA if device.type == "cuda"
            else torch.profiler.ProfilerActivity.CPU]
    prof = torch.profiler.profile(activities=acts)
    hist = core.histograms["iteration_tokens_total"]
    mark: dict[str, Any] = {}

    def on_step(n: int) -> None:
        if n == start:
            sync(device)
            mark.update(t=time.perf_counter(), gen=core.counters["generation_tokens_total"],
                        h=(list(hist.counts), hist.count, hist.sum))
            prof.__enter__()
        elif n == start + window:
            sync(device)
            mark["wall"] = time.perf_counter() - mark["t"]
            mark["gen"] = core.counters["generation_tokens_total"] - mark["gen"]
            mark["tokens"] = step_token_histogram(hist, *mark["h"])
            prof.__exit__(None, None, None)

    try:
        run_closed_loop(core, prompts, a.output_len, a.concurrency, None, None, "prof-srv",
                        a.temperature, on_step)
    finally:
        if "t" in mark and "wall" not in mark:
            prof.__exit__(None, None, None)
    if "wall" not in mark:
        raise RuntimeError(f"the run ended before step {start + window}")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_cat = by_category((e.name, e.time_range.elapsed_us()) for e in kernels)
    gpu_us = sum(by_cat.values())
    wall = mark["wall"]
    busy_us, gaps = busy_and_gaps(kernels)
    res = {"first_step": start, "steps": window,
           "wall_ms_per_step": round(wall / window * 1e3, 3),
           "gpu_kernel_ms_per_step": round(gpu_us / window / 1e3, 3),
           "gpu_busy_fraction": round(gpu_us / 1e6 / wall, 3) if device.type == "cuda"
           else None,
           "kernels_per_step": round(len(kernels) / window, 1),
           "gpu_busy_ms_per_step": round(busy_us / window / 1e3, 3),
           "idle_ms_per_step_by_gap": {k: round(v / window / 1e3, 3) for k, v in gaps.items()},
           "output_tokens_per_step": round(mark["gen"] / window, 2),
           "output_tok_per_s": round(mark["gen"] / wall, 1),
           "step_tokens": mark["tokens"],
           "gpu_ms_per_step": {k: round(v / window / 1e3, 3)
                               for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}}
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    with open(table_path, "a") as f:
        f.write(f"=== serving steady state, steps {start}..{start + window - 1}, wall "
                f"{res['wall_ms_per_step']} ms/step ===\n{table}\n")
    return res


def profile_decode(core: EngineCore, rng: random.Random, vocab: int, batch: int,
                   input_len: int, steps: int, device: torch.device, table_path: Path
                   ) -> list[dict[str, Any]]:
    """Profiles ``steps`` pure-decode steps at ``batch`` sequences of ~``input_len`` context:
    wall time per step against GPU kernel time per step, launches per step, top kernels."""
    runner = core.runner
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    trackers = []
    for i in range(batch):
        tr = Tracker(f"prof{batch}-{i}")
        core.add(RequestState(tr.rid, random_prompt(rng, input_len, vocab), params, tr.emit))
        trackers.append(tr)
    while core.scheduler.num_waiting or any(not t.token_times for t in trackers):
        core.step()
    core.step()  # one plain decode step
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    results = []
    graphs = runner.graphs
    try:
        for mode in ("graphs", "eager") if graphs is not None else ("eager",):
            runner.graphs = graphs if mode == "graphs" else None
            core.step()  # settle into the mode outside the profile
            sync(device)
            results.append(_profile_steps(core, batch, input_len, steps, mode, acts, device,
                                          table_path))
    finally:
        runner.graphs = graphs
        for t in trackers:
            core.abort(t.rid)
    return results


def profile_mixed(core: EngineCore, rng: random.Random, vocab: int, batch: int,
                  input_len: int, steps: int, device: torch.device, table_path: Path
                  ) -> dict[str, Any]:
    """Profiles ``steps`` mixed steps: ``batch - 4`` decoding sequences of ~``input_len``
    context plus 4 waiting long prompts that are prefilled in chunks alongside them (at
    most the engine's mixed-step budget per step)."""
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 16, ignore_eos=True)
    trackers = []
    for i in range(batch - 4):
        tr = Tracker(f"mix{batch}-{i}")
        core.add(RequestState(tr.rid, random_prompt(rng, input_len, vocab), params, tr.emit))
        trackers.append(tr)
    while core.scheduler.num_waiting or any(not t.token_times for t in trackers):
        core.step()
    long_len = core.max_model_len - params.max_tokens - 8
    for i in range(4):
        tr = Tracker(f"mixlong-{i}")
        core.add(RequestState(tr.rid, random_prompt(rng, long_len, vocab), params, tr.emit))
        trackers.append(tr)
    core.step()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        res = _profile_steps(core, batch, input_len, steps, "mixed", acts, device, table_path)
    finally:
        for t in trackers:
            core.abort(t.rid)
    res["step_tokens"] = core.scheduler.config.max_mixed_tokens
    return res


def _profile_steps(core: EngineCore, batch: int, input_len: int, steps: int, mode: str,
                   acts: list, device: torch.device, table_path: Path) -> dict[str, Any]:
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync(device)
        wall = time.perf_counter() - t0
    res: dict[str, Any] = {"batch": batch, "mode": mode, "context": input_len,
                           "steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3)}
    try:
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.time_range.elapsed_us() for e in kernels)
        res["gpu_kernel_ms_per_step"] = round(gpu_us / steps / 1e3, 3)
        res["kernels_per_step"] = round(len(kernels) / steps, 1)
        res["gpu_busy_fraction"] = round(gpu_us / 1e6 / wall, 3) if device.type == "cuda" \
            else None
    except Exception as e:  # noqa: BLE001 - profiler internals differ between versions
        res["kernel_sum_error"] = repr(e)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
    except Exception:  # noqa: BLE001
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(table_path, "a") as f:
        f.write(f"=== decode batch {batch} ({mode}), context ~{input_len}, {steps} steps, "
                f"wall {res['wall_ms_per_step']} ms/step ===\n{table}\n")
    return res

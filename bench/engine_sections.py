"""The measured sections of ``bench_engine.py`` (decode, prefill, serving) and their
bookkeeping; the profiler's looks at the same workloads are ``engine_profiles.py``. Run
through ``bench_engine.py``."""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alloc_trace import (  # noqa: E402  (bench/alloc_trace.py)
    created_segments,
    segment_blockers,
    trace_events,
)
from measure import sync  # noqa: E402  (bench/measure.py)

from tpserve.model.memory import start_memory_history  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.model.sampling_params import SamplingParams  # noqa: E402
from tpserve.parallel.moe import ParallelExperts  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.outputs import RequestOutput  # noqa: E402
from tpserve.server.engine.request_state import RequestState  # noqa: E402


class StubTokenizer:
    """Just enough of a tokenizer for the detokenizer: one character per token, no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)

    def convert_ids_to_tokens(self, ids):
        return ["x"] * len(ids) if isinstance(ids, list) else "x"


class Tracker:
    """Per-request timestamps and tokens, filled by the engine's ``emit`` callback."""

    def __init__(self, rid: str):
        self.rid = rid
        self.t_add = time.perf_counter()
        self.token_times: list[float] = []
        self.tokens: list[int] = []
        self.finished = False
        self.error: str | None = None

    def emit(self, out: RequestOutput | BaseException) -> None:
        now = time.perf_counter()
        if isinstance(out, BaseException):
            self.error, self.finished = repr(out), True
            return
        for d in out.deltas:
            self.token_times.extend([now] * len(d.token_ids))
            self.tokens.extend(d.token_ids)
        if out.finished:
            self.finished = True


# --------------------------------------------------------------------------- helpers
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms_stats(xs: list[float]) -> dict[str, float | None]:
    r = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    return {"mean": r(statistics.fmean(xs)) if xs else None, "p50": r(pct(xs, 50)),
            "p99": r(pct(xs, 99))}


def alloc_stats(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    keys = ("segment.all.current", "segment.all.allocated", "num_alloc_retries",
            "num_device_alloc", "reserved_bytes.all.current", "allocated_bytes.all.peak")
    return {k: int(s.get(k, 0)) for k in keys}


# --------------------------------------------------------------------------- sections
def weight_bytes_read_per_step(runner: ModelRunner) -> tuple[int, int, int, int]:
    """(bytes a batch-1 decode step reads from the weights, total params, params applied to
    every prefill token, LM-head params). The embedding is a gather (a few rows), so its
    bytes are left out unless it is tied to the LM head, which reads all of it; of a mixture
    of experts' experts only the ``k`` of ``E`` one token takes count."""
    model = runner.model
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    params = list(model.parameters())  # tied weights appear once
    total = sum(p.numel() for p in params)
    read = sum(p.numel() * p.element_size() for p in params)
    if head is not emb:
        read -= emb.numel() * emb.element_size()
        per_token = total - emb.numel() - head.numel()
    else:
        per_token = total - emb.numel()
    # a mixture of experts: one token takes k of E experts per sparse layer, so a batch-1
    # step reads (and a prefill token multiplies) k / E of the expert weights
    cfg = runner.model_config
    unused = 1 - cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0.0
    for module in model.modules():
        if isinstance(module, ParallelExperts):
            for p in (module.w13, module.w2):
                read -= int(p.numel() * p.element_size() * unused)
                per_token -= int(p.numel() * unused)
    return read, total, per_token, head.numel()


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run_closed_loop(core: EngineCore, prompts: list[list[int]], output_len: int,
                    concurrency: int, time_limit: float | None, waste: list[float] | None,
                    tag: str, temperature: float = 0.0,
                    on_step: Callable[[int], None] | None = None,
                    prompt_logprobs: int | None = None, lora_slots: int = 0,
                    ignore_eos: bool = True,
                    logprobs: int | None = None) -> tuple[list[Tracker], float, int]:
    """Keeps at most ``concurrency`` requests in flight, adding one whenever one finishes,
    until every prompt ran or ``time_limit`` passed (then the ones in flight finish).
    ``on_step(n)`` is called after the n-th step; ``prompt_logprobs`` scores every prompt
    (the completions API's ``echo`` with ``logprobs``); ``lora_slots`` > 0: prompt i runs
    under LoRA adapter ``i % lora_slots``; ``ignore_eos`` False: a request may end at EOS
    before ``output_len``; ``logprobs``: each token's log-probability and that many top
    alternatives (with their texts). Returns the trackers (in finishing order), the wall
    time and the number of steps."""
    params = SamplingParams(temperature=temperature, max_tokens=output_len,
                            ignore_eos=ignore_eos, prompt_logprobs=prompt_logprobs,
                            logprobs=logprobs)
    pending = deque(enumerate(prompts))
    inflight: list[Tracker] = []
    done: list[Tracker] = []
    bm, bs = core.block_manager, core.block_size
    steps = 0
    t0 = time.perf_counter()
    while pending or inflight:
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            pending.clear()
        while pending and len(inflight) < concurrency:
            i, p = pending.popleft()
            tr = Tracker(f"{tag}-{i}")
            slot = i % lora_slots if lora_slots else None  # a start-up adapter: id = slot
            mine = replace(params, lora_slot=slot, lora_id=slot) if lora_slots else params
            core.add(RequestState(tr.rid, p, mine, tr.emit))
            inflight.append(tr)
        if not inflight:
            break
        core.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
        if waste is not None:
            used = bm.num_used_blocks * bs
            if used:
                live = sum(s.num_computed_tokens for s in core.scheduler.running)
                waste.append(1.0 - live / used)
        still = []
        for tr in inflight:
            if tr.finished:
                if tr.error:
                    raise RuntimeError(f"request {tr.rid} failed: {tr.error}")
                done.append(tr)
            else:
                still.append(tr)
        inflight = still
    return done, time.perf_counter() - t0, steps


def decode_batch1(core: EngineCore, rng: random.Random, vocab: int, input_len: int,
                  output_len: int, weight_bytes: int, kv_per_token: int,
                  copy_gbps: float, lora_slots: int = 0) -> dict[str, Any]:
    done, wall, steps = run_closed_loop(core, [random_prompt(rng, input_len, vocab)],
                                        output_len, 1, None, None, "b1",
                                        lora_slots=lora_slots)
    tr = done[0]
    n = len(tr.token_times)
    tpot = (tr.token_times[-1] - tr.token_times[0]) / (n - 1)
    # average context read per decode step: positions input_len+1 .. input_len+output_len-1
    avg_ctx = input_len + output_len / 2
    step_bytes = weight_bytes + kv_per_token * avg_ctx
    return {"input_len": input_len, "output_len": n, "tok_per_s": round(1 / tpot, 2),
            "tpot_ms": round(tpot * 1e3, 3),
            "ttft_ms": round((tr.token_times[0] - tr.t_add) * 1e3, 2),
            "itl_ms_p50": round(statistics.median(
                b - a for a, b in zip(tr.token_times[:-1], tr.token_times[1:], strict=True))
                * 1e3, 3),
            "bytes_per_step": int(step_bytes),
            "mbu": round(step_bytes / tpot / (copy_gbps * 1e9), 4)}


def prefill(core: EngineCore, rng: random.Random, vocab: int, seqs: int, input_len: int,
            reps: int, flops_per_step: float, tflops: float, device: torch.device
            ) -> dict[str, Any]:
    """Steps that are pure prefill: ``seqs`` fresh prompts admitted and computed in one step
    (``max_tokens=1``, so each request ends in that same step)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    overlap, core.async_scheduling = core.async_scheduling, False  # one step, read back
    try:
        return _prefill_steps(core, rng, vocab, seqs, input_len, reps, flops_per_step,
                              tflops, device, params, times)
    finally:
        core.async_scheduling = overlap


def _prefill_steps(core, rng, vocab, seqs, input_len, reps, flops_per_step, tflops, device,
                   params, times) -> dict[str, Any]:
    for r in range(reps + 1):  # the first is a warm-up
        trackers = []
        for i in range(seqs):
            tr = Tracker(f"pf-{r}-{i}")
            core.add(RequestState(tr.rid, random_prompt(rng, input_len, vocab), params,
                                  tr.emit))
            trackers.append(tr)
        sync(device)
        t0 = time.perf_counter()
        core.step()
        sync(device)
        dt = time.perf_counter() - t0
        if core.has_unfinished or not all(t.finished for t in trackers):
            raise RuntimeError("the prefill step did not take all prompts in one step")
        if r:
            times.append(dt)
    t = statistics.median(times)
    tokens = seqs * input_len
    return {"seqs": seqs, "input_len": input_len, "tokens_per_step": tokens,
            "step_ms_median": round(t * 1e3, 3), "step_ms_all": [round(x * 1e3, 3) for x in times],
            "tok_per_s": round(tokens / t, 1), "flops_per_step": flops_per_step,
            "mfu": round(flops_per_step / t / (tflops * 1e12), 4)}


def decode_figures(a, R, core, runner, rng, vocab, weight_bytes, kv_per_token, lim, save,
                    log) -> None:
    """Batch-1 decode, with the CUDA graphs and (unless serving only) without them."""
    graphs = runner.graphs
    R["decode_batch1"] = decode_batch1(core, rng, vocab, a.decode_input_len,
                                       a.decode_output_len, weight_bytes, kv_per_token,
                                       lim["copy_GBps"], a.lora_adapters)
    save()
    d = R["decode_batch1"]
    log(f"batch-1 decode: {d['tok_per_s']} tok/s, TPOT {d['tpot_ms']} ms, MBU {d['mbu']}")
    if graphs is not None and not a.serving_only:  # the same decode without the graphs
        runner.graphs = None
        try:  # a short request first, so that kernel compiles stay out of the figure
            run_closed_loop(core, [random_prompt(rng, a.decode_input_len, vocab)], 4, 1,
                            None, None, "b1-eager-warm")
            R["decode_batch1_eager"] = decode_batch1(
                core, rng, vocab, a.decode_input_len, a.decode_output_len, weight_bytes,
                kv_per_token, lim["copy_GBps"], a.lora_adapters)
        finally:
            runner.graphs = graphs
        save()
        e = R["decode_batch1_eager"]
        log(f"batch-1 decode, eager: {e['tok_per_s']} tok/s, TPOT {e['tpot_ms']} ms")


def history_from_warmup(a, device: torch.device) -> dict[str, Any] | None:
    """With ``--serving-memory-history warmup`` on CUDA: turns the allocator's history on
    now (before the warm-up) and returns the allocator's snapshot at this point, which
    ``serving`` replays the trace from; else None."""
    if a.serving_memory_history != "warmup" or device.type != "cuda":
        return None
    start_memory_history(device, 2_000_000)
    return torch.cuda.memory._snapshot()


def serving(core: EngineCore, rng: random.Random, vocab: int, a, device: torch.device,
            history_start: dict[str, Any] | None = None
            ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The closed-loop serving run. With ``a.serving_memory_history`` the allocator's
    history is recorded over it (or, given ``history_start``, the snapshot taken when it
    was turned on before the warm-up, it already runs), and the report names the stack
    behind every segment the run creates and (``history_start``) what kept the cached
    segments from serving it (``alloc_trace.segment_blockers``)."""
    prompts = [random_prompt(rng, a.input_len, vocab) for _ in range(a.num_prompts)]
    waste: list[float] = []
    before = alloc_stats(device)
    segs_before = _segments(device)
    c0 = dict(core.counters)
    hist = core.histograms["iteration_tokens_total"]
    h0 = list(hist.counts), hist.count, hist.sum
    history = bool(a.serving_memory_history) and device.type == "cuda"
    since = 0  # the trace index where the serving run starts
    if history and history_start is not None:
        since = len(trace_events(torch.cuda.memory._snapshot()))
    elif history:  # slows every allocation: the run's speed is then not a figure
        start_memory_history(device, 2_000_000)
    done, wall, steps = run_closed_loop(core, prompts, a.output_len, a.concurrency,
                                        a.serving_time_limit, waste, "srv", a.temperature,
                                        lora_slots=a.lora_adapters,
                                        logprobs=a.logprobs)
    sync(device)
    snap = None
    if history:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    after = alloc_stats(device)
    new_segs = [s for addr, s in _segments(device).items() if addr not in segs_before]
    ttft = [t.token_times[0] - t.t_add for t in done]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in done
            if len(t.token_times) > 1]
    itl = [b - a_ for t in done for a_, b in zip(t.token_times[:-1], t.token_times[1:], strict=True)]
    out_tokens = sum(len(t.token_times) for t in done)
    e2e = [t.token_times[-1] - t.t_add for t in done]
    srv = {"concurrency": a.concurrency, "temperature": a.temperature,
           "logprobs": a.logprobs,
           "num_prompts_requested": a.num_prompts,
           "num_prompts": len(done), "time_limit_s": a.serving_time_limit,
           "input_len": a.input_len, "output_len": a.output_len, "duration_s": round(wall, 3),
           "steps": steps, "output_tokens": out_tokens,
           "output_tok_per_s": round(out_tokens / wall, 1),
           "total_tok_per_s": round((out_tokens + len(done) * a.input_len) / wall, 1),
           "request_per_s": round(len(done) / wall, 3),
           "ttft_ms": ms_stats(ttft), "tpot_ms": ms_stats(tpot), "itl_ms": ms_stats(itl),
           "e2e_ms": ms_stats(e2e),
           "step_tokens": step_token_histogram(hist, *h0),
           "engine_ms_per_step": {  # where the engine loop's time went, per step
               k: round((core.counters[key] - c0[key]) / max(steps, 1) * 1e3, 3)
               for k, key in (("host", "step_host_seconds_total"),
                              ("device_wait", "device_wait_seconds_total"))}}
    seg = {"before": before, "after": after}
    if before:
        seg["new_segments"] = after["segment.all.allocated"] - before["segment.all.allocated"]
        seg["segment_current_delta"] = (after["segment.all.current"]
                                        - before["segment.all.current"])
        seg["new_alloc_retries"] = after["num_alloc_retries"] - before["num_alloc_retries"]
        # what the segments created during the run hold now (sizes only: no stack traces,
        # which would slow every allocation of the measured run)
        seg["new_segment_contents"] = [
            {"pool": s["segment_type"], "total_size": s["total_size"],
             "blocks": [[b["size"], b["state"]] for b in s["blocks"]][:32]}
            for s in new_segs]
    if snap is not None:
        seg["created_in_trace"], seg["freed_in_trace"], _ = created_segments(snap, 40, since)
        if history_start is not None:
            seg["blockers"] = segment_blockers(history_start, trace_events(snap), since, 24)
    kv = {"mean": round(statistics.fmean(waste), 5) if waste else None,
          "max": round(max(waste), 5) if waste else None, "steps": len(waste)}
    return srv, seg, kv


def step_token_histogram(hist, counts0: list[int], count0: int, sum0: float
                         ) -> dict[str, Any]:
    """The tokens per step of the steps since ``(counts0, count0, sum0)`` (a reading of the
    engine's ``iteration_tokens_total`` histogram): the mean and the steps per bucket, each
    bucket named by its upper bound (``>LAST`` above the last)."""
    n = hist.count - count0
    per = {f"<={b}": c - c0 for b, c, c0 in zip(hist.bounds, hist.counts, counts0,
                                               strict=True) if c - c0}
    above = n - sum(per.values())
    if above:
        per[f">{hist.bounds[-1]}"] = above
    return {"steps": n, "mean": round((hist.sum - sum0) / n, 1) if n else None,
            "steps_per_bucket": per}


def _segments(device: torch.device) -> dict[int, dict]:
    if device.type != "cuda":
        return {}
    return {s["address"]: s for s in torch.cuda.memory_snapshot()}

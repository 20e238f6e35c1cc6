"""Hugging Face transformers baseline: ``generate()`` on random Llama-3-8B weights, one GPU.

The peer figure for ``bench_engine.py``'s serving section, on the same workload shape:
batches of 64 random prompts of exactly 1024 tokens, 256 greedy output tokens each
(``min_new_tokens`` = ``max_new_tokens``, the equivalent of ``ignore_eos``), bf16 weights
drawn from normal(0, 0.02) directly on the GPU. It does not import tpserve.

Sections, in order, each written to the JSON as soon as it is measured:

1. ``limits``: device copy bandwidth and bf16 matmul rate (the method of ``bench_engine.py``).
2. ``warmup``: two short ``generate`` calls at the timed shape (64 x 1024, a static cache for
   1024 + 256 tokens) stopped after a few tokens; the first absorbs ``torch.compile``, the
   second shows what a call costs once compiled. If compiling fails or runs past
   ``--compile-timeout``, the run falls back to the default dynamic cache (eager) and says so.
3. ``batch64``: as many full batches as fit in ``--timed-s`` (at least one, at most
   ``--max-batches``). ``output_tok_per_s`` = 64 * 256 * batches / total generate seconds.
4. ``batch1``: one prompt of 1024 tokens, 256 new tokens, if the time budget still allows
   (after two short batch-1 calls: the first absorbs the recompile for the new shape).

    python3 bench/bench_hf.py --out /tmp/hf.json                 # on the GPU machine
    python bench/bench_hf.py --tiny --out /tmp/hf-tiny.json      # logic check on CPU
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the budget counts from here, imports included

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from measure import git_commit, measure_limits, sync  # noqa: E402  (bench/measure.py)
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=128000, eos_token_id=[128001, 128009],
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192})
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

FULL = dict(batch=64, input_len=1024, output_len=256, timed_s=150.0, max_batches=10,
            budget_s=250.0, compile_timeout=170.0, warmup_tokens=8, copy_mib=2048,
            matmul_n=8192)
SMALL = dict(batch=2, input_len=16, output_len=8, timed_s=5.0, max_batches=3, budget_s=120.0,
             compile_timeout=60.0, warmup_tokens=2, copy_mib=16, matmul_n=256)


class Timeout(Exception):
    pass


@contextmanager
def deadline(seconds: float):
    """Raises ``Timeout`` in the main thread after ``seconds`` (SIGALRM; POSIX only)."""
    def fire(signum, frame):
        raise Timeout(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class StopAfter(StoppingCriteria):
    """Stops every row after ``n`` new tokens (warm-up calls: the cache keeps its full size,
    so the compiled shapes are those of the timed calls)."""

    def __init__(self, prompt_len: int, n: int):
        self.stop_at = prompt_len + n

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] >= self.stop_at
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool,
                          device=input_ids.device)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype,
                seed: int) -> LlamaForCausalLM:
    """Constructs the model on ``device`` in ``dtype`` (no host copy) and fills it in place:
    norms with ones, every other weight with normal(0, 0.02)."""
    config = LlamaConfig(**shape)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def random_prompts(batch: int, length: int, vocab: int, g: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=g, device=device)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the JSON goes")
    p.add_argument("--tiny", action="store_true",
                   help="logic check: hidden 64, 2 layers, vocab 1000, batch 2, 16 in / 8 out")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--cache", choices=("static", "dynamic"), default="static",
                   help="static: cache_implementation='static' (auto-compiled on GPU)")
    p.add_argument("--skip-batch1", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--note", action="append", default=[], help="a note to record")
    for k, v in FULL.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                       help=f"default {v} (tiny: {SMALL[k]})")
    a = p.parse_args()
    for k, v in (SMALL if a.tiny else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def _header(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The result's identification: commit, date, device, versions, settings, notes."""
    on_gpu = device.type == "cuda"
    N = a.output_len
    return {
        "git_commit": git_commit(a.git_commit)[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if on_gpu
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(),
        "settings": {"shape": "tiny" if a.tiny else "llama3-8b", "dtype": str(dtype)[6:],
                     "cache_requested": a.cache, **{k: getattr(a, k) for k in FULL},
                     "greedy": True, "min_new_tokens": N, "max_new_tokens": N, "seed": a.seed},
        "notes": list(a.note)}


def _build(a: argparse.Namespace, R: dict, shape: dict, device: torch.device,
           dtype: torch.dtype, save: Callable, log: Callable):
    """Builds the random-weight model and records its description."""
    t = time.perf_counter()
    model = build_model(shape, device, dtype, a.seed)
    sync(device)
    cfg = model.config
    R["model"] = {"params": sum(p.numel() for p in model.parameters()),
                  "build_s": round(time.perf_counter() - t, 2),
                  "attn_implementation": getattr(cfg, "_attn_implementation", None),
                  "rope": getattr(cfg, "rope_parameters", None),
                  "rotary_type": getattr(model.model.rotary_emb, "rope_type", None),
                  "param_dtype": str(next(model.parameters()).dtype)[6:],
                  "param_device": str(next(model.parameters()).device)}
    save()
    log(f"model: {R['model']}")
    return model


def _generator(model, device: torch.device, N: int) -> Callable:
    """``generate(ids, cache, stop_after=None) -> (seconds, sequences)``: one greedy
    ``model.generate`` call of ``N`` new tokens (or ``stop_after``), timed."""
    gen_kw = dict(do_sample=False, num_beams=1, max_new_tokens=N, min_new_tokens=N,
                  pad_token_id=0, return_dict_in_generate=False)

    def generate(ids: torch.Tensor, cache: str, stop_after: int | None = None) -> tuple:
        kw = dict(gen_kw)
        if cache == "static":
            kw["cache_implementation"] = "static"
        else:
            kw["disable_compile"] = True
        if stop_after is not None:
            kw["stopping_criteria"] = [StopAfter(ids.shape[1], stop_after)]
        sync(device)
        t0 = time.perf_counter()
        seqs = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # no_grad inside
        sync(device)
        return time.perf_counter() - t0, seqs

    return generate


def _warmup(a: argparse.Namespace, R: dict, generate: Callable, prompts: Callable,
            on_gpu: bool, left: Callable, save: Callable, log: Callable) -> tuple[str, dict]:
    """Warm-up at the timed shape; falls back to the dynamic cache if compiling fails.
    Returns the cache used and the warm-up record."""
    B, notes = a.batch, R["notes"]
    cache = a.cache
    W: dict[str, Any] = {"cache": cache, "batch": B, "new_tokens": a.warmup_tokens}
    R["warmup"] = W
    if cache == "static":
        try:
            with deadline(min(a.compile_timeout, left() - 30)):
                W["first_s"], _ = generate(prompts(B), "static", a.warmup_tokens)
            W["second_s"], _ = generate(prompts(B), "static", a.warmup_tokens)
            W["compiled"] = on_gpu  # generate() compiles the decode step on GPUs only
        except Exception as e:  # noqa: BLE001 - fall back to the eager dynamic cache
            W["static_failure"] = repr(e)[:2000]
            log(f"static cache failed: {W['static_failure']}; falling back to dynamic")
            notes.append(f"static cache + compile failed or was too slow ({repr(e)[:300]}); "
                         "measured with the default dynamic cache, eager.")
            if hasattr(torch, "_dynamo"):
                torch._dynamo.reset()
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            cache = W["cache"] = "dynamic"
    if cache == "dynamic":
        W["first_s"], _ = generate(prompts(B), "dynamic", a.warmup_tokens)
        W["second_s"], _ = generate(prompts(B), "dynamic", a.warmup_tokens)
        W["compiled"] = False
    W = {k: round(v, 3) if isinstance(v, float) else v for k, v in W.items()}
    R["warmup"] = W
    R["cache_used"] = cache
    save()
    log(f"warm-up: {W}")
    return cache, W


def _timed_batches(a: argparse.Namespace, R: dict, generate: Callable, prompts: Callable,
                   cache: str, W: dict, left: Callable, save: Callable,
                   log: Callable) -> list[float]:
    """Timed batches of ``a.batch`` prompts until the time (or batch) limit; returns the
    seconds of each."""
    B, L, N = a.batch, a.input_len, a.output_len
    times: list[float] = []
    bad_lengths = 0
    t_start = time.perf_counter()
    while len(times) < a.max_batches:
        if times:
            remaining = min(a.timed_s - (time.perf_counter() - t_start), left() - 15)
            if remaining < max(times[-1], 0) * 1.1:
                break
        dt, seqs = generate(prompts(B), cache)
        bad_lengths += int(seqs.shape != (B, L + N))
        times.append(dt)
        log(f"batch #{len(times)} (size {B}): {dt:.2f} s, {B * N / dt:.1f} out tok/s")
        R["batch64"] = {
            "batch": B, "input_len": L, "output_len": N, "cache": cache, "batches": len(times),
            "prompts": B * len(times), "output_tokens": B * N * len(times),
            "generate_s_total": round(sum(times), 3),
            "generate_s_each": [round(x, 3) for x in times],
            "output_tok_per_s": round(B * N * len(times) / sum(times), 1),
            "total_tok_per_s": round(B * (L + N) * len(times) / sum(times), 1),
            "output_tok_per_s_excl_first": (round(B * N * (len(times) - 1) / sum(times[1:]), 1)
                                            if len(times) > 1 else None),
            "wrong_output_lengths": bad_lengths}
        save()
    r = R["batch64"]
    if W.get("second_s"):  # a short call is prefill + warmup_tokens decode steps
        step = (statistics.median(times) - W["second_s"]) / (N - a.warmup_tokens)
        r["decode_step_ms_est"] = round(step * 1e3, 3)
        r["prefill_plus_short_decode_s"] = W["second_s"]
    save()
    log(f"batch size {B}: {r['batches']} batches, {r['output_tok_per_s']} out tok/s")
    return times


def _batch1(a: argparse.Namespace, R: dict, generate: Callable, prompts: Callable,
            cache: str, W: dict, times: list[float], left: Callable, log: Callable) -> None:
    """Batch 1, if the budget still allows a compile for the new shape."""
    B, L, N, notes = a.batch, a.input_len, a.output_len, R["notes"]
    need = (W.get("first_s", 0) if cache == "static" else 0) + 2 * statistics.median(times) / B
    need = min(need, a.compile_timeout) + 10
    if a.skip_batch1:
        R["batch1"] = None
        notes.append("batch1 skipped (--skip-batch1).")
    elif left() < need:
        R["batch1"] = None
        notes.append(f"batch1 skipped: {left():.0f} s of budget left, about {need:.0f} s "
                     "needed (a compile for batch 1 and the run).")
    else:
        try:
            with deadline(left() - 5):  # the first short call absorbs the recompile
                w1, _ = generate(prompts(1), cache, a.warmup_tokens)
                w2, _ = generate(prompts(1), cache, a.warmup_tokens)
                dt, seqs = generate(prompts(1), cache)
            R["batch1"] = {"input_len": L, "output_len": N, "cache": cache,
                           "warmup_s": round(w1, 3), "short_s": round(w2, 3),
                           "generate_s": round(dt, 3), "tok_per_s": round(N / dt, 2),
                           "decode_step_ms_est": round((dt - w2) / (N - a.warmup_tokens) * 1e3,
                                                       3),
                           "wrong_output_length": seqs.shape != (1, L + N)}
            log(f"batch 1: {R['batch1']}")
        except Exception as e:  # noqa: BLE001 - batch 1 is a bonus figure
            R["batch1"] = {"error": repr(e)[:2000]}
            log(f"batch 1 failed: {e!r}")


def _closing_notes(R: dict, cache: str, on_gpu: bool) -> None:
    """How to read the figures, appended to the notes."""
    notes = R["notes"]
    notes.append("output_tok_per_s = batch * output_len * batches / total generate() seconds; "
                 "each generate() call includes its prefill (eager in transformers) and "
                 "output_len - 1 decode steps.")
    if cache == "static" and on_gpu:
        notes.append("cache_implementation='static': transformers compiles the decode step "
                     "(torch.compile, mode reduce-overhead); the warm-up calls absorb it.")


def main() -> int:
    a = parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = TINY if a.tiny else LLAMA3_8B

    def left() -> float:
        return a.budget_s - (time.perf_counter() - T0)

    R = _header(a, device, dtype)

    def save() -> None:
        out.write_text(json.dumps(R, indent=2) + "\n")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}",
              flush=True)

    save()
    log(f"device {R['device']}, torch {R['torch']}, transformers {R['transformers']}")
    R["limits"] = measure_limits(device, a.copy_mib, a.matmul_n)
    if on_gpu:
        torch.cuda.empty_cache()
    save()
    log(f"limits: copy {R['limits']['copy_GBps']} GB/s, matmul {R['limits']['bf16_tflops']} "
        "TFLOP/s")

    model = _build(a, R, shape, device, dtype, save, log)
    g = torch.Generator(device=device).manual_seed(a.seed)
    vocab = model.config.vocab_size

    def prompts(batch: int) -> torch.Tensor:
        return random_prompts(batch, a.input_len, vocab, g, device)

    generate = _generator(model, device, a.output_len)
    cache, W = _warmup(a, R, generate, prompts, on_gpu, left, save, log)
    times = _timed_batches(a, R, generate, prompts, cache, W, left, save, log)
    _batch1(a, R, generate, prompts, cache, W, times, left, log)
    if on_gpu:
        R["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    _closing_notes(R, cache, on_gpu)
    save()
    print(json.dumps({k: R.get(k) for k in ("limits", "warmup", "batch64", "batch1")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

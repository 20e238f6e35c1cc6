"""Engine benchmark: one rank, dummy weights of a real shape (or a checkpoint folder,
``--load-format safetensors``), driven through ``EngineCore``.

Measures, in one process and one run: the device's copy bandwidth and bf16 matmul rate (the
two ceilings), start-up time and memory plan, batch-1 decode (TPOT, MBU), pure-prefill steps
(tokens/s, MFU), a closed-loop serving run (at most ``--concurrency`` requests in flight, a
new one added whenever one finishes; TTFT, TPOT, ITL), allocator segments created during the
serving run, KV-block waste, and a short torch.profiler look at decode steps. Writes JSON
(rewritten after every section, so a run cut short still leaves its figures) and prints a
summary.

    python bench/bench_engine.py --out bench/results/h200-2026-11-29.json \
        --git-commit "$(git rev-parse HEAD)"
    python bench/bench_engine.py --small --device cpu --out /tmp/bench.json   # logic check

Detokenization uses a stub tokenizer (one character per token): dummy shapes have no
tokenizer of their own, and the figures are then the model's and the engine's, without the
cost of a real tokenizer's ``decode``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_profiles import (  # noqa: E402  (bench/engine_profiles.py)
    profile_decode,
    profile_mixed,
    profile_serving,
)
from engine_sections import (  # noqa: E402  (bench/engine_sections.py)
    StubTokenizer,
    decode_figures,
    history_from_warmup,
    prefill,
    random_prompt,
    run_closed_loop,
    serving,
    weight_bytes_read_per_step,
)
from gpu_power import PowerSampler, describe  # noqa: E402  (bench/gpu_power.py)
from lora_adapters import write_random_adapters  # noqa: E402  (bench/lora_adapters.py)
from measure import git_commit, measure_limits  # noqa: E402  (bench/measure.py)

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.loader.checkpoint import open_checkpoint  # noqa: E402
from tpserve.model.plan import CMD_SHUTDOWN  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.parallel.state import TPGroup, pick_device  # noqa: E402
from tpserve.server.config import Config, config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.startup import join_group, leave_group  # noqa: E402

FULL = dict(model="llama3-8b", device="auto", dtype="bfloat16", kv_cache_dtype="auto",
            max_model_len=2048,
            max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
            kv_cache_memory=None, num_prompts=640, concurrency=64, input_len=1024,
            output_len=256, serving_time_limit=120.0, decode_input_len=1024,
            decode_output_len=256, prefill_seqs=8, prefill_reps=5, warmup_prompts=64,
            warmup_output_len=16, profile_steps=8, copy_mib=2048, matmul_n=8192,
            temperature=0.0)
SMALL = dict(model="smollm2-135m", device="cpu", dtype="float32", kv_cache_dtype="auto",
             max_model_len=512,
             max_num_seqs=4, max_num_batched_tokens=256, gpu_memory_utilization=0.9,
             kv_cache_memory=64 << 20, num_prompts=6, concurrency=4, input_len=64,
             output_len=8, serving_time_limit=60.0, decode_input_len=64, decode_output_len=8,
             prefill_seqs=4, prefill_reps=2, warmup_prompts=2, warmup_output_len=2,
             profile_steps=2, copy_mib=64, matmul_n=512, temperature=0.0)


# --------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the JSON goes")
    p.add_argument("--small", action="store_true", help="tiny CPU-friendly defaults")
    p.add_argument("--git-commit", default=None,
                   help="commit of the code (else $TPSERVE_GIT_COMMIT, else git rev-parse)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="with --serving-only: the per-kernel profiles as well")
    p.add_argument("--profile-serving", type=int, default=0, metavar="STEPS",
                   help="after the serving run, profile STEPS steps of its steady state "
                        "(a closed loop of 3 x concurrency prompts): GPU time by kernel "
                        "category and the GPU's busy fraction (0: off)")
    p.add_argument("--serving-memory-history", nargs="?", const="serving", default=None,
                   choices=("serving", "warmup"),
                   help="record the allocator's history during the serving run (from the "
                        "warm-up on: 'warmup') and report the stack behind every segment it "
                        "creates, and with 'warmup' what fragments the cached ones (slows "
                        "the run)")
    p.add_argument("--serving-only", action="store_true",
                   help="batch-1 decode and serving only (no eager decode, prefill, profile)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512,
                   help="largest mixed-step graph (0: pure-decode graphs only)")
    p.add_argument("--max-mixed-tokens", type=int, default=None,
                   help="step budget while sequences decode (default: the largest graph)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks; 1..N-1 are spawned (one GPU each on CUDA, gloo on CPU)")
    p.add_argument("--tp-comm", choices=("allreduce", "allgather"), default="allreduce",
                   help="how row-parallel layers finish (see tpserve serve --tp-comm)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="NCCL for every all-reduce (no peer-to-peer one/two-shot)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture of experts: experts whole on each rank")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="the serving run's requests ask for each token's log-probability "
                        "and K top alternatives")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens back before scheduling the next")
    p.add_argument("--note", action="append", default=[], help="a note to record")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "safetensors"],
                   help="dummy: random weights of the --model shape; safetensors: --model is "
                        "a checkpoint folder (e.g. bench/make_fp8_checkpoint.py's)")
    p.add_argument("--lora-adapters", type=int, default=0,
                   help="serve this many random LoRA adapters of the shape (all seven "
                        "projections), request i under adapter i %% N (0: no LoRA)")
    p.add_argument("--lora-rank", type=int, default=16, help="their rank")
    p.add_argument("--quantization", default="none", choices=["none", "fp8", "auto", "gptq",
                                                              "awq"],
                   help="weight quantization (the server's --quantization)")
    p.add_argument("--fp8-weight-only-max-tokens", type=int, default=None,
                   help="the server's flag of that name (default: the server's default)")
    p.add_argument("--fp8-fast-accum", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's flag of that name (default: the server's default)")
    p.add_argument("--overlap-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's --overlap-attention (default: the server's default)")
    p.add_argument("--kv-cache-hadamard", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's flag of that name (default: the server's default)")
    p.add_argument("--speculative-config", default=None,
                   help="the server's flag of that name (a JSON object)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="the server's flag of that name")
    for k, v in FULL.items():
        typ = float if isinstance(v, float) else int if isinstance(v, int) else str
        p.add_argument("--" + k.replace("_", "-"), type=typ, default=None,
                       help=f"default {v} (small: {SMALL[k]})")
    a = p.parse_args()
    base = SMALL if a.small else FULL
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def server_config(a: argparse.Namespace, device: torch.device) -> Config:
    """The server's own config tree for these flags, resolved as ``tpserve serve`` does."""
    argv = ["serve", a.model, "--load-format", a.load_format, "--dtype", a.dtype,
            "--kv-cache-dtype", a.kv_cache_dtype,
            "--seed", str(a.seed), "--device", device.type,
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--gpu-memory-utilization", str(a.gpu_memory_utilization),
            "--cuda-graph-max-tokens", str(a.cuda_graph_max_tokens),
            "--tensor-parallel-size", str(a.tensor_parallel_size), "--tp-comm", a.tp_comm]
    if a.disable_custom_all_reduce:
        argv.append("--disable-custom-all-reduce")
    if a.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if a.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", str(a.kv_cache_memory)]
    if a.max_mixed_tokens is not None:
        argv += ["--max-mixed-tokens", str(a.max_mixed_tokens)]
    if a.enforce_eager:
        argv.append("--enforce-eager")
    if a.no_async_scheduling:
        argv.append("--no-async-scheduling")
    argv += ["--quantization", a.quantization]
    if a.fp8_weight_only_max_tokens is not None:
        argv += ["--fp8-weight-only-max-tokens", str(a.fp8_weight_only_max_tokens)]
    if a.fp8_fast_accum is not None:
        argv += ["--fp8-fast-accum" if a.fp8_fast_accum else "--no-fp8-fast-accum"]
    if a.kv_cache_hadamard is not None:
        argv += ["--kv-cache-hadamard" if a.kv_cache_hadamard else "--no-kv-cache-hadamard"]
    if a.overlap_attention is not None:
        argv += ["--overlap-attention" if a.overlap_attention else "--no-overlap-attention"]
    if a.calculate_kv_scales:
        argv.append("--calculate-kv-scales")
    if a.speculative_config is not None:
        argv += ["--speculative-config", a.speculative_config]
    if a.lora_adapters:
        config = open_checkpoint(a.model, a.load_format).config
        folders = write_random_adapters(config, a.lora_adapters, a.lora_rank,
                                        Path(tempfile.mkdtemp(prefix="tpserve-lora-")))
        argv += ["--enable-lora", "--max-lora-rank", str(a.lora_rank), "--lora-modules",
                 *(f"lora-{i}={f}" for i, f in enumerate(folders))]
    parser, _ = build_parser()
    return config_from_args(parser.parse_args(argv))


def main() -> int:
    a = parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table_path = out.with_suffix(".profile.txt")
    table_path.unlink(missing_ok=True)
    device = pick_device(0, a.device)
    commit, dirty = git_commit(a.git_commit)
    R: dict[str, Any] = {
        "git_commit": commit, "git_dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "triton": None, "python": platform.python_version(),
        "config": {k: getattr(a, k) for k in FULL}, "quantization": a.quantization,
        "parallel": {"tensor_parallel_size": a.tensor_parallel_size, "tp_comm": a.tp_comm,
                     "disable_custom_all_reduce": a.disable_custom_all_reduce,
                     "expert_parallel": a.enable_expert_parallel},
        "lora": {"adapters": a.lora_adapters, "rank": a.lora_rank} if a.lora_adapters
        else None,
        "notes": []}
    try:
        import triton
        R["triton"] = triton.__version__
    except ImportError:
        pass
    notes = R["notes"]
    notes.extend(a.note)

    def save() -> None:
        out.write_text(json.dumps(R, indent=2) + "\n")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    save()
    log(f"device {R['device']}, torch {R['torch']}, triton {R['triton']}")
    lim = measure_limits(device, a.copy_mib, a.matmul_n)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the plan reads free memory: give the buffers back first
    R["limits"] = lim
    save()
    log(f"limits: copy {lim['copy_GBps']} GB/s, matmul {lim['bf16_tflops']} TFLOP/s")

    cfg = server_config(a, device)
    R["kv_cache"] = {"dtype": cfg.runner.kv_cache_dtype,
                     "hadamard": cfg.runner.kv_cache_hadamard,
                     "calculate_kv_scales": cfg.runner.calculate_kv_scales}
    group, workers = TPGroup(0, 1, device, None), None
    if a.tensor_parallel_size > 1:  # the server's own start-up: spawn and watch the ranks
        group, workers = join_group(cfg, lambda reason: log(f"a worker rank failed: {reason}"))
    try:
        return _run(a, R, cfg, group, device, lim, notes, save, log, out, table_path,
                    commit, dirty)
    finally:
        if workers is not None:
            leave_group(group, workers)


def _start_runner(a, R, cfg: Config, group, device, notes, save, log):
    """Builds the runner (falling back to eager when CUDA graphs fail on one GPU) and
    records start-up time, kernels, graphs and memory plan. Returns (runner, cfg)."""
    t0 = time.perf_counter()
    runner, failure = None, None
    try:
        runner = ModelRunner(cfg.runner, cfg.scheduler.limits, group)
    except Exception as e:  # noqa: BLE001 - fall back to eager below, outside this frame
        if cfg.runner.enforce_eager or device.type != "cuda" or group.world_size > 1:
            raise
        failure = repr(e)
    if runner is None:
        log(f"start-up with CUDA graphs failed ({failure}); retrying with enforce_eager")
        notes.append(f"start-up with CUDA graphs failed: {failure}; measured eagerly")
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        cfg = dataclasses.replace(
            cfg, runner=dataclasses.replace(cfg.runner, enforce_eager=True),
            scheduler=dataclasses.replace(cfg.scheduler, max_mixed_tokens=a.max_mixed_tokens))
        runner = ModelRunner(cfg.runner, cfg.scheduler.limits, group)
    R["startup_s"] = round(runner.startup_s, 2)
    R["startup_wall_s"] = round(time.perf_counter() - t0, 2)
    R["kernels"] = runner.ops.name
    graphs = runner.graphs
    R["cuda_graphs"] = None if graphs is None else {
        "decode_buckets": graphs.decode_buckets, "mixed_buckets": graphs.mixed_buckets,
        "captured_bytes": graphs.captured_bytes, "pool_bytes": graphs.pool_bytes,
        "reserved_delta": graphs.reserved_delta}
    R["memory_plan"] = runner.plan.describe()
    pl = runner.plan
    R["memory_plan_bytes"] = {"weights": pl.weights, "workspace": pl.workspace,
                              "cuda_graphs": pl.cuda_graphs,
                              "graphs_reserve": pl.graphs_reserve,
                              "kv_pool": pl.kv_pool, "num_blocks": pl.num_blocks,
                              "block_size": pl.block_size, "total": pl.total,
                              "kv_cache_dtype": pl.kv_cache_dtype, "kv_tokens": pl.kv_tokens}
    R["memory_plan_per_rank"] = runner.rank_plans
    save()
    log(f"start-up {R['startup_s']} s, kernels {runner.ops.name}")
    for line in R["memory_plan"]:
        print("   ", line)
    return runner, cfg


def _prefill_figures(a, R, core, mcfg, rng, vocab, per_token_params, head_params, lim,
                     device, save, log) -> None:
    """Prefill throughput and MFU (skipped when serving only)."""
    # prefill flops: linear layers on every token, the head on the sampled rows, and causal
    # attention (QK^T and PV over the lower triangle)
    L, s = a.input_len, a.prefill_seqs
    attn = 4 * mcfg.num_hidden_layers * mcfg.num_attention_heads * mcfg.head_dim \
        * (L * (L + 1) / 2) * s
    head = 2 * head_params * s
    flops = 2 * per_token_params * L * s + head + attn
    if not a.serving_only:
        R["prefill"] = prefill(core, rng, vocab, s, L, a.prefill_reps, flops,
                               lim["bf16_tflops"], device)
        R["prefill"]["attention_flops_included"] = attn
        save()
        p = R["prefill"]
        log(f"prefill: {p['tok_per_s']} tok/s, step {p['step_ms_median']} ms, MFU {p['mfu']}")


def _serving_figures(a, R, core, rng, vocab, device, save, log, history=None) -> dict:
    """The closed-loop serving run; returns its figures."""
    d = R["decode_batch1"]
    with PowerSampler(device) as power:
        srv, seg, kv = serving(core, rng, vocab, a, device, history)
    srv["gpu_power"] = power.summary()
    if srv["gpu_power"].get("energy_j") is not None:
        srv["joules_per_output_token"] = round(srv["gpu_power"]["energy_j"]
                                               / srv["output_tokens"], 5)
    R["serving"], R["allocator"], R["kv_waste"] = srv, seg, kv
    R["new_segments_after_warmup"] = seg.get("new_segments")
    # the plan against every rank's allocator once serving reserved the workspace
    live = core.runner.gather_allocator()
    R["plan_vs_allocator"] = [
        {"rank": i, "plan_held": p["held"], "reserved": r.reserved, "allocated": r.allocated,
         "fragmentation": round(r.fragmentation, 4), "num_alloc_retries": r.num_alloc_retries,
         "num_ooms": r.num_ooms, "disagreement": round((r.reserved - p["held"]) / p["held"], 4)}
        for i, (p, r) in enumerate(zip(core.runner.rank_plans, live, strict=False))]
    log("plan vs allocator: " + ", ".join(f"rank {x['rank']} {100 * x['disagreement']:+.1f} %"
                                         for x in R["plan_vs_allocator"]))
    R["tpot_p50_over_batch1"] = (round(srv["tpot_ms"]["p50"] / d["tpot_ms"], 3)
                                 if srv["tpot_ms"]["p50"] else None)
    save()
    log(f"serving: {srv['num_prompts']} prompts, {srv['output_tok_per_s']} out tok/s, "
        f"TTFT p50/p99 {srv['ttft_ms']['p50']}/{srv['ttft_ms']['p99']} ms, TPOT p50/p99 "
        f"{srv['tpot_ms']['p50']}/{srv['tpot_ms']['p99']} ms, ITL p50/p99 "
        f"{srv['itl_ms']['p50']}/{srv['itl_ms']['p99']} ms")
    log(f"new segments {R['new_segments_after_warmup']}, KV waste {kv['mean']}")
    if srv["gpu_power"].get("samples"):
        log("GPU while serving: " + describe(srv["gpu_power"])
            + (f", {srv['joules_per_output_token']} J an output token"
               if "joules_per_output_token" in srv else ""))
    return srv


def _profiles(a, R, core, rng, vocab, device, table_path, save, log) -> None:
    """Per-kernel profiles of decode (batch 1 and the concurrency) and of a mixed step."""
    R["profile"] = []
    for batch in (1, a.concurrency):
        try:
            R["profile"].extend(profile_decode(core, rng, vocab, batch, a.input_len,
                                               a.profile_steps, device, table_path))
        except Exception as e:  # noqa: BLE001 - the profile is a bonus, not a figure
            R["profile"].append({"batch": batch, "error": repr(e)})
        save()
        for r in R["profile"]:
            if r["batch"] == batch:
                log(f"profile: {r}")
    try:
        R["profile"].append(profile_mixed(core, rng, vocab, a.concurrency, a.input_len,
                                          a.profile_steps, device, table_path))
    except Exception as e:  # noqa: BLE001 - the profile is a bonus, not a figure
        R["profile"].append({"mode": "mixed", "error": repr(e)})
    save()
    log(f"profile: {R['profile'][-1]}")


def _notes(a, runner, srv, notes, commit, dirty) -> None:
    """The run's caveats, appended to ``notes``."""
    notes.append("hf_baseline / ratio_vs_hf not run: transformers generate() on 8B random "
                 "weights costs minutes of device time this session did not have; see "
                 "/work/shared/GUIDE.md section 3 for earlier peer figures on this card.")
    notes.append("serving_http not run: this run drives EngineCore directly (no HTTP, no "
                 "asyncio thread hop).")
    if runner.graphs is None:
        notes.append("decode ran eagerly (no CUDA graphs): Triton kernels for norms, RoPE+KV "
                     "write and attention, cuBLAS for matmuls, one launch each.")
    else:
        notes.append("pure-decode steps replay CUDA graphs (one per batch bucket), steps with "
                     "prefill replay one per token bucket up to cuda_graphs.mixed_buckets[-1] "
                     "tokens, larger steps run eagerly. decode_batch1_eager is the same "
                     "decode with the graphs switched off.")
    notes.append("Detokenization uses a stub tokenizer (one char per token): dummy shapes have "
                 "no tokenizer, and the embedded SmolLM2 one is not on the GPU machine.")
    notes.append("MBU counts every parameter but the embedding (a gather) plus 128 KiB of KV "
                 "per context token at the average context of the run.")
    notes.append("prefill MFU counts linear layers on every token, the LM head on sampled "
                 "rows only, and causal attention flops (4*layers*heads*head_dim*L(L+1)/2).")
    if srv["num_prompts"] < a.num_prompts:
        notes.append(f"serving stopped admitting after {a.serving_time_limit} s: "
                     f"{srv['num_prompts']} of {a.num_prompts} prompts ran.")
    if commit and dirty is None:
        notes.append("git_commit given by the caller (HEAD where the run was launched); the "
                     "bench script itself may have been uncommitted at that point.")


def _run(a, R, cfg: Config, group, device, lim, notes, save, log, out, table_path, commit,
         dirty) -> int:
    runner, cfg = _start_runner(a, R, cfg, group, device, notes, save, log)
    pl = runner.plan
    core = EngineCore(runner, StubTokenizer(), cfg.scheduler, cfg.engine)
    R["engine"] = {"async_scheduling": core.async_scheduling,
                   "overlap_attention": cfg.runner.overlap_attention,
                   "max_mixed_tokens": core.scheduler.config.max_mixed_tokens}
    mcfg = runner.model_config
    vocab = mcfg.vocab_size
    rng = random.Random(a.seed)
    kv_per_token = pl.bytes_per_block // pl.block_size
    weight_bytes, total_params, per_token_params, head_params = \
        weight_bytes_read_per_step(runner)
    quant = runner.ckpt.quantization
    R["model"] = {"shape": a.model, "load_format": a.load_format, "tp": group.world_size,
                  "checkpoint_quantization": quant.describe() if quant else None,
                  "params_on_rank0": total_params, "weight_bytes_per_decode_step":
                  weight_bytes, "kv_bytes_per_token": kv_per_token,
                  "params_per_prefill_token": per_token_params}

    history = history_from_warmup(a, device)
    # warm-up: compiles the kernels for prefill and large-batch decode shapes
    t = time.perf_counter()
    run_closed_loop(core, [random_prompt(rng, a.input_len, vocab)
                           for _ in range(a.warmup_prompts)], a.warmup_output_len,
                    a.concurrency, None, None, "warm", lora_slots=a.lora_adapters)
    R["warmup_s"] = round(time.perf_counter() - t, 2)
    log(f"warm-up {R['warmup_s']} s")

    decode_figures(a, R, core, runner, rng, vocab, weight_bytes, kv_per_token, lim, save,
                    log)
    _prefill_figures(a, R, core, mcfg, rng, vocab, per_token_params, head_params, lim,
                     device, save, log)
    srv = _serving_figures(a, R, core, rng, vocab, device, save, log, history)
    if a.profile_serving:
        R["profile_serving"] = profile_serving(core, rng, vocab, a, device, table_path,
                                               a.profile_serving)
        save()
        log(f"serving profile: {R['profile_serving']}")
    if not a.skip_profile and (a.profile or not a.serving_only):
        _profiles(a, R, core, rng, vocab, device, table_path, save, log)
    R["hf_baseline"] = None
    R["ratio_vs_hf"] = None
    R["serving_http"] = None
    R["engine"]["counters"] = {k: v for k, v in core.counters.items()
                               if k.startswith("spec_decode") or k == "steps_total"}
    _notes(a, runner, srv, notes, commit, dirty)
    save()
    print(json.dumps({k: R.get(k) for k in ("limits", "startup_s", "decode_batch1",
                                            "prefill", "new_segments_after_warmup",
                                            "kv_waste", "tpot_p50_over_batch1")}, indent=1))
    print(json.dumps(R["serving"], indent=1))
    runner.send_command(CMD_SHUTDOWN)  # workers leave their loop (no-op at tp 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

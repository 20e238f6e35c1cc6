"""Embedding benchmark (``--runner pooling``): one rank, dummy weights of a real shape, driven
through ``EngineCore`` as the server drives it.

Measures, in one process: the embeddings' agreement with the torch reference back-end on
the same weights (cosine similarity in the model's dtype, max |difference| in float32),
batch-1 latency of a short input, offline throughput (``--num-prompts`` inputs of
``--input-len`` tokens submitted at once: input tokens/s, embeddings/s, model TFLOP/s),
and transformers' own forward on the same shape as the baseline (``AutoModel``, sdpa,
equal-length batches: no padding, its best case). Writes JSON.

    python bench/bench_embeddings.py --model qwen3-0.6b --out bench/results/x.json
    python bench/bench_embeddings.py --small --out /tmp/emb.json   # logic check on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_sections import StubTokenizer  # noqa: E402  (bench/engine_sections.py)
from measure import git_commit  # noqa: E402  (bench/measure.py)

from tpserve.cli import build_parser  # noqa: E402
from tpserve.model.loader import dummy  # noqa: E402
from tpserve.model.runner import ModelRunner  # noqa: E402
from tpserve.model.sampling_params import PoolingParams, SamplingParams  # noqa: E402
from tpserve.parallel.state import TPGroup, pick_device  # noqa: E402
from tpserve.server.config import config_from_args  # noqa: E402
from tpserve.server.engine.engine_core import EngineCore  # noqa: E402
from tpserve.server.engine.request_state import RequestState  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b", help="a dummy shape")
    p.add_argument("--small", action="store_true", help="CPU logic check: tiny sizes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--short-len", type=int, default=32, help="batch-1 latency input")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' batch size")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--git-commit", default=None)
    return p.parse_args()


def build_core(a: argparse.Namespace, backend: str, dtype: str) -> EngineCore:
    device = "cpu" if a.small else "auto"
    argv = ["serve", a.model, "--load-format", "dummy", "--runner", "pooling",
            "--device", device, "--dtype", dtype, "--kernel-backend", backend,
            "--max-model-len", str(max(a.input_len, a.short_len) + 16),
            "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--gpu-memory-utilization", "0.45"]
    if a.small:
        argv += ["--kv-cache-memory", "64MiB"]
    cfg = config_from_args(build_parser()[0].parse_args(argv))
    group = TPGroup(0, 1, pick_device(0, cfg.runner.device), None)
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, group)
    return EngineCore(runner, StubTokenizer(), cfg.scheduler, cfg.engine)


def embed(core: EngineCore, prompts: list[list[int]]) -> tuple[list[list[float]], float]:
    """Every prompt's embedding, all submitted at once, and the seconds it took."""
    outs: list[list] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add(RequestState(f"r{i}-{random.random()}", p,
                              SamplingParams(pooling=PoolingParams()), outs[i].append))
    while core.has_unfinished:
        core.step()
    took = time.perf_counter() - t0
    return [o[-1].embedding for o in outs], took


def reference_vectors(a, backend: str, dtype: str, prompts) -> list[list[float]]:
    core = build_core(a, backend, dtype)
    try:
        return embed(core, prompts)[0]
    finally:
        core.close()


def release() -> None:
    """Frees the dropped cores' device memory (KV pool, weights) before the next plans."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check(a, vectors: dict[str, list[list[float]]]) -> dict:
    """Agreement of each Triton run with the torch reference of the same dtype."""
    out = {}
    for dtype in ("float32", a.dtype):
        tri = torch.tensor(vectors[f"triton-{dtype}"])
        ref = torch.tensor(vectors[f"torch-{dtype}"])
        cos = torch.nn.functional.cosine_similarity(tri, ref, dim=1)
        out[dtype] = {"min_cosine": cos.min().item(),
                      "max_abs_diff": (tri - ref).abs().max().item()}
    return out


def hf_baseline(a: argparse.Namespace, device: torch.device) -> dict:
    """transformers' base model forward, equal-length batches (no padding), sdpa."""
    import transformers as tf

    cfg = tf.AutoConfig.for_model(**{k: v for k, v in dummy.shape_hf_config(a.model).items()
                                      if k != "architectures"})
    model = tf.AutoModel.from_config(cfg, dtype=getattr(torch, a.dtype),
                                     attn_implementation="sdpa").to(device).eval()
    ids = torch.randint(0, cfg.vocab_size, (a.hf_batch, a.input_len), device=device)
    batches = max(1, a.num_prompts // a.hf_batch)
    with torch.inference_mode():
        for _ in range(2):
            model(ids)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(batches):
            model(ids).last_hidden_state[:, -1].float().cpu()
        took = time.perf_counter() - t0
    tokens = batches * a.hf_batch * a.input_len
    return {"batch": a.hf_batch, "tokens": tokens, "seconds": took, "tokens_per_s": tokens / took,
            "transformers": tf.__version__}


def main() -> None:
    a = parse_args()
    if a.small:
        a.model, a.dtype, a.num_prompts, a.input_len = "smollm2-135m", "float32", 16, 64
        a.max_num_seqs, a.max_num_batched_tokens, a.check_prompts = 8, 256, 4
        a.skip_hf = True
    sha, dirty = git_commit(a.git_commit)
    result: dict = {"commit": sha, "dirty": dirty, "date": datetime.date.today().isoformat(),
                    "host": platform.node(), "args": vars(a)}
    rng = random.Random(0)
    vocab = dummy.shape_hf_config(a.model)["vocab_size"]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    checks = [prompt(rng.randrange(8, a.input_len)) for _ in range(a.check_prompts)]
    vectors = {}
    for backend, dtype in (("torch", "float32"), ("torch", a.dtype)) + (
            () if a.small else (("triton", "float32"),)):
        vectors[f"{backend}-{dtype}"] = reference_vectors(a, backend, dtype, checks)
        release()
    core = build_core(a, "auto", a.dtype)
    backend = core.runner.cfg.kernel_backend
    vectors[f"{'triton' if backend == 'triton' else 'torch'}-{a.dtype}"], _ = embed(core, checks)
    if not a.small:
        result["agreement"] = check(a, vectors)
    device = core.runner.device
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result["kernel_backend"] = backend
    result["memory_plan"] = dataclasses.asdict(core.runner.plan)
    short = [prompt(a.short_len) for _ in range(20)]
    embed(core, short[:3])  # warm
    lat = [embed(core, [p])[1] for p in short]
    result["batch1"] = {"input_len": a.short_len, "median_ms": statistics.median(lat) * 1e3,
                        "p90_ms": sorted(lat)[int(0.9 * len(lat))] * 1e3}
    prompts = [prompt(a.input_len) for _ in range(a.num_prompts)]
    embed(core, prompts[: a.max_num_seqs])  # warm the step shapes
    steps0 = core.counters["steps_total"]
    _, took = embed(core, prompts)
    tokens = a.num_prompts * a.input_len
    params = sum(p.numel() for n, p in core.runner.model.named_parameters()
                 if "embed_tokens" not in n)
    result["throughput"] = {
        "prompts": a.num_prompts, "input_len": a.input_len, "seconds": took,
        "tokens_per_s": tokens / took, "embeddings_per_s": a.num_prompts / took,
        "steps": core.counters["steps_total"] - steps0,
        "linear_tflops": 2 * params * tokens / took / 1e12, "non_embedding_params": params}
    if not a.skip_hf and device.type == "cuda":
        core.close()
        del core
        release()
        result["transformers"] = hf_baseline(a, device)
        result["speedup_vs_transformers"] = (result["throughput"]["tokens_per_s"]
                                             / result["transformers"]["tokens_per_s"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()

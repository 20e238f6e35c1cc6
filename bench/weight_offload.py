"""Weights streamed from host memory on the GPU (``--cpu-offload-gb``): what the device
gives to the KV cache instead, and what each step pays, on a real ``EngineCore`` (dummy
weights of the given folder's shape, bf16, Triton kernels, CUDA graphs, the memory plan at
``--gpu-memory-utilization 0.9``).

Per run: the start-up time, the plan (weights on the device, KV pool), the streamed layers,
a greedy request's 64 tokens after a 256-token prompt (their time per token: batch-1
decode through the graphs) and 16 such requests at once (decode tokens a second), the
tokens compared with a run without offloading (pass its JSON as BASELINE). One JSON
document; exits 1 if the tokens differ from the baseline's.

    python3 bench/weight_offload.py .benchdata/llama3-8b GIB [COMMIT] [BASELINE_JSON]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.scheduler import SchedulerConfig

GIB = 2 ** 30


def generate(core: EngineCore, n: int, tag: str) -> tuple[list[list[int]], float, int]:
    """``n`` greedy requests of 64 tokens after distinct 256-token prompts, at once: their
    tokens, the seconds from the first decode step to the end, and the decode steps."""
    outs: list[list] = [[] for _ in range(n)]
    for i in range(n):
        prompt = [(j * 7919 + i * 104729) % 50000 + 100 for j in range(256)]
        core.add(RequestState(f"{tag}{i}", prompt, SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True), outs[i].append))
    core.step()  # the prefills (one step at 4096 batched tokens)
    torch.cuda.synchronize()
    t0, steps = time.monotonic(), 0
    while core.has_unfinished:
        core.step()
        steps += 1
    torch.cuda.synchronize()
    seconds = time.monotonic() - t0
    return [[t for o in out for d in o.deltas for t in d.token_ids] for out in outs], \
        seconds, steps


def main() -> None:
    folder, gib = sys.argv[1], float(sys.argv[2])
    commit = sys.argv[3] if len(sys.argv) > 3 else None
    baseline = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model=folder, load_format="dummy", dtype="bfloat16", device="cuda",
                       kernel_backend="triton", gpu_memory_utilization=0.9,
                       cpu_offload_bytes=int(gib * GIB))
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                            max_model_len=4096, block_size=16)
    t0 = time.monotonic()
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, dev, None))
    core = EngineCore(runner, runner.ckpt.tokenizer(), sched, EngineConfig())
    plan, stream = runner.plan, runner.model.weight_stream
    out = {"device": torch.cuda.get_device_name(), "commit": commit, "model": folder,
           "cpu_offload_gb": gib, "startup_s": round(time.monotonic() - t0, 1),
           "plan_gib": {"weights": round(plan.weights / GIB, 3),
                        "kv_pool": round(plan.kv_pool / GIB, 3),
                        "cuda_graphs": round(plan.cuda_graphs / GIB, 3)},
           "kv_tokens": plan.kv_tokens,
           "streamed": None if stream is None else {
               **stream.report(), "host_gib": round(stream.host_bytes / GIB, 3)}}
    generate(core, 1, "warm")
    tokens, seconds, steps = generate(core, 1, "one")
    out["batch1"] = {"ms_per_token": round(1000 * seconds / steps, 2),
                     "tok_s": round(steps / seconds, 1)}
    many, seconds, steps = generate(core, 16, "many")
    out["batch16"] = {"decode_steps": steps, "tok_s": round(16 * steps / seconds, 1)}
    if stream is not None:  # the bytes each step copies over the host link
        per_step = stream.count * stream.layout.weight_bytes
        out["streamed"]["gib_per_step"] = round(per_step / GIB, 3)
        out["streamed"]["host_link_gb_s_at_batch1"] = round(
            per_step / 1e9 / (out["batch1"]["ms_per_token"] / 1000), 1)
    out["tokens"] = {"one": tokens[0], "many": many}
    ok = True
    if baseline is not None:
        ok = baseline["tokens"] == out["tokens"]
        out["same_tokens_as_baseline"] = ok
    print(json.dumps(out, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

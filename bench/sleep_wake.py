"""Sleep mode on the GPU (``--enable-sleep-mode``): what a sleep gives back and how long a
sleep and a wake-up take, through the engine's own queries on a real ``EngineCore``
(dummy weights of the given folder's shape, bf16, Triton kernels, CUDA graphs, the memory
plan at ``--gpu-memory-utilization``).

Per level: a greedy request's tokens awake; the sleep (device free memory before and
after, the allocator's reserved bytes); the wake-up (its time, of which the graphs'
capture); the same request's tokens after it, which must be equal. Then a wake-up in two
parts (tags), a reload of the weights in place, and a wake-up refused for want of memory: a co-tenant tensor takes the free memory
while the engine sleeps, the wake-up is a 503 and the engine stays asleep, the tensor goes,
the wake-up succeeds. Prints one JSON document; exits 1 if any check fails.

    python3 bench/sleep_wake.py .benchdata/llama3-8b [COMMIT]
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
from tpserve.server.engine.control import EngineMemoryError
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.queries import run_query
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.scheduler import SchedulerConfig

GIB = 2 ** 30


def free_gib() -> float:
    torch.cuda.synchronize()
    return round(torch.cuda.mem_get_info()[0] / GIB, 3)


def reserved_gib() -> float:
    return round(torch.cuda.memory_reserved() / GIB, 3)


def greedy(core: EngineCore, rid: str) -> list[int]:
    outs = []
    prompt = [(i * 7919) % 50000 + 100 for i in range(256)]
    core.add(RequestState(rid, prompt, SamplingParams(temperature=0, max_tokens=64,
                                                      ignore_eos=True), outs.append))
    while core.has_unfinished:
        core.step()
    return [t for o in outs for d in o.deltas for t in d.token_ids]


def timed(core: EngineCore, query) -> tuple[dict, float]:
    t0 = time.monotonic()
    answer = run_query(core, query)
    torch.cuda.synchronize()
    return answer, round(time.monotonic() - t0, 3)


def main() -> None:
    folder = sys.argv[1]
    commit = sys.argv[2] if len(sys.argv) > 2 else None
    dev = torch.device("cuda", 0)
    cfg = RunnerConfig(model=folder, load_format="dummy", dtype="bfloat16", device="cuda",
                       kernel_backend="triton", gpu_memory_utilization=0.9)
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                            max_model_len=8192, block_size=16)
    t0 = time.monotonic()
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, dev, None))
    core = EngineCore(runner, runner.ckpt.tokenizer(), sched,
                      EngineConfig(enable_sleep_mode=True))
    startup = round(time.monotonic() - t0, 1)
    plan = runner.plan
    out = {"device": torch.cuda.get_device_name(), "commit": commit, "model": folder,
           "startup_s": startup, "plan_gib": {
               "weights": round(plan.weights / GIB, 3), "kv_pool": round(plan.kv_pool / GIB, 3),
               "cuda_graphs": round(plan.cuda_graphs / GIB, 3)},
           "levels": {}}
    ok = True
    awake = greedy(core, "ref")
    for level in (1, 2):
        row: dict = {"free_gib_awake": free_gib(), "reserved_gib_awake": reserved_gib()}
        answer, row["sleep_s"] = timed(core, ("sleep", level, "abort"))
        row["free_gib_asleep"], row["reserved_gib_asleep"] = free_gib(), reserved_gib()
        row["given_back_gib"] = round(row["free_gib_asleep"] - row["free_gib_awake"], 3)
        row["sleep_ranks"] = answer["ranks"]
        answer, row["wake_s"] = timed(core, ("wake_up", None))
        row["wake_ranks"] = answer["ranks"]
        row["free_gib_woken"] = free_gib()
        row["same_tokens"] = greedy(core, f"after{level}") == awake
        ok &= row["same_tokens"]
        out["levels"][level] = row
    # two parts: the weights, then the pool (and the graphs)
    run_query(core, ("sleep", 1, "abort"))
    parts = {}
    for tag in ("weights", "kv_cache"):
        answer, seconds = timed(core, ("wake_up", (tag,)))
        parts[tag] = {"s": seconds, "is_sleeping": answer["is_sleeping"],
                      "free_gib": free_gib()}
    parts["same_tokens"] = greedy(core, "parts") == awake
    ok &= parts["same_tokens"] and not parts["kv_cache"]["is_sleeping"]
    out["wake_in_parts"] = parts
    # the served checkpoint read again in place (dummy: regenerated), under the graphs
    answer, seconds = timed(core, ("reload_weights", ""))
    out["reload"] = {"s": seconds, "same_tokens": greedy(core, "reload") == awake}
    ok &= out["reload"]["same_tokens"]
    # a co-tenant takes the free memory while the engine sleeps
    run_query(core, ("sleep", 1, "abort"))
    blocker = torch.empty(torch.cuda.mem_get_info()[0] - GIB, dtype=torch.uint8, device=dev)
    refused = {"co_tenant_gib": round(blocker.numel() / GIB, 3)}
    try:
        run_query(core, ("wake_up", None))
        refused["refused"] = False
    except EngineMemoryError as e:
        refused["refused"], refused["message"] = True, str(e)
    refused["still_asleep"] = run_query(core, "is_sleeping")
    refused["weights_empty"] = all(p.untyped_storage().nbytes() == 0
                                   for p in runner.model.parameters())
    del blocker
    torch.cuda.empty_cache()
    run_query(core, ("wake_up", None))
    refused["same_tokens_after"] = greedy(core, "refused") == awake
    ok &= all(refused[k] for k in ("refused", "still_asleep", "weights_empty",
                                   "same_tokens_after"))
    out["wake_refused"] = refused
    out["all_checks_passed"] = bool(ok)
    print(json.dumps(out, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Rank 0's start-up, shared by ``serve`` (engine in the HTTP process) and
``engine_process`` (engine in its own process): join or spawn the tensor-parallel group,
build the model runner, the tokenizer and the ``EngineCore``."""

from __future__ import annotations

import logging
from collections.abc import Callable

from tpserve.model.runner import ModelRunner, run_worker
from tpserve.parallel.launch import WorkerProcesses
from tpserve.parallel.state import (
    TPGroup,
    destroy_tp_group,
    init_tp_group,
    init_tp_group_from_env,
    pick_device,
    torchrun_env,
)
from tpserve.server.config import Config
from tpserve.server.engine.engine_core import EngineCore

logger = logging.getLogger("tpserve")


def join_group(cfg: Config, on_worker_failure: Callable[[str], None]
               ) -> tuple[TPGroup, WorkerProcesses | None]:
    """This process's rank: torchrun's, or rank 0 spawning ranks 1..N-1 (watched; a worker
    that dies or raises is reported through ``on_worker_failure``)."""
    tp = cfg.parallel.tensor_parallel_size
    timeout = cfg.parallel.collective_timeout_s
    env = torchrun_env()
    if env is not None:
        if env[1] != tp:
            raise ValueError(f"torchrun started {env[1]} processes but "
                             f"--tensor-parallel-size is {tp}")
        return init_tp_group_from_env(cfg.runner.device, timeout), None
    device = pick_device(0, cfg.runner.device)
    if tp == 1:
        return TPGroup(0, 1, device, None), None
    workers = WorkerProcesses(run_worker, tp, (cfg.runner, cfg.scheduler.limits, timeout),
                              on_failure=on_worker_failure)
    workers.start()
    return init_tp_group(0, tp, workers.init_method, device, timeout), workers


def leave_group(group: TPGroup | None, workers: WorkerProcesses | None) -> None:
    """Waits for the spawned workers (killing leftovers), then leaves the group."""
    if workers is not None:
        workers.stop(timeout=10.0)
    if group is not None:
        destroy_tp_group(group)


def build_engine_core(cfg: Config, group: TPGroup, replica: int = 0) -> EngineCore:
    """Rank 0: the runner (weights, memory plan, KV pool, graphs; logged), the tokenizer
    and the engine core; ``replica``: its data-parallel index (the unseeded requests'
    generator is seeded with ``--seed`` + it, so the replicas draw unlike numbers; the
    weights, dummy ones included, still come from ``--seed``)."""
    runner = ModelRunner(cfg.runner, cfg.scheduler.limits, group, show_progress=True)
    for line in runner.plan.describe():
        logger.info(line)
    logger.info("kernels: %s; tensor parallel size %d; start-up took %.1f s",
                runner.ops.name, group.world_size, runner.startup_s)
    tokenizer = runner.ckpt.tokenizer()
    core = EngineCore(runner, tokenizer, cfg.scheduler, cfg.engine, replica=replica)
    try:
        core.grammars.prepare()  # the tokenizer's vocabulary for structured output, once
    except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer larger than the logits
        logger.warning("structured output is unavailable for this tokenizer: %s", exc)
    return core

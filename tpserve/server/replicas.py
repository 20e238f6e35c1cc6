"""Where data-parallel replicas run (``--data-parallel-size``; ``data_parallel.py``).

Replica ``r`` of ``N`` sees only GPUs ``r x tp .. r x tp + tp - 1`` of this process's
``CUDA_VISIBLE_DEVICES`` (or of every GPU): its engine process sets that variable before
CUDA starts (``engine_process``), and its ranks inherit it. Off CUDA the replicas share
the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tpserve.parallel.state import ParallelConfig


@dataclass(frozen=True)
class Replica:
    """Replica ``index`` of ``count``; ``visible_devices``: its engine process's
    ``CUDA_VISIBLE_DEVICES`` (None: leave the environment as it is)."""

    index: int = 0
    count: int = 1
    visible_devices: str | None = None

    @property
    def name(self) -> str:
        return "engine" if self.count == 1 else f"engine {self.index}"


ONLY = Replica()  # the engine of a server without data parallelism


def plan_replicas(parallel: ParallelConfig, device: str) -> list[Replica]:
    """Each replica's GPUs (module doc); ValueError when there are too few."""
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    if dp == 1:
        return [ONLY]
    if device != "cuda":
        return [Replica(r, dp) for r in range(dp)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible is not None
           else [str(i) for i in range(torch.cuda.device_count())])
    if len(ids) < dp * tp:
        raise ValueError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} needs "
                         f"{dp * tp} GPUs, but {len(ids)} are visible")
    return [Replica(r, dp, ",".join(ids[r * tp:(r + 1) * tp])) for r in range(dp)]


def check_data_parallel(parallel: ParallelConfig, engine_process: bool,
                        under_torchrun: bool) -> None:
    """ValueError naming the flag where replicas cannot run."""
    dp = parallel.data_parallel_size
    if dp == 1:
        return
    if under_torchrun:
        raise ValueError(f"--data-parallel-size {dp}: not under torchrun (multi-node); run "
                         "one tpserve per replica behind a load balancer")
    if not engine_process:
        raise ValueError(f"--data-parallel-size {dp} needs the engine process: each replica "
                         "is one (drop --no-engine-process)")

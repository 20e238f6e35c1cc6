"""Process groups for tensor parallelism: NCCL on CUDA, gloo on CPU.

Two ways in: ``init_tp_group`` with an explicit rank, world size and rendezvous (single
host: a private ``FileStore``, see ``rendezvous``; gloo then binds loopback only), or
``init_tp_group_from_env`` under torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT (the multi-node path: the endpoint the user gives).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpserve.parallel.rendezvous import LOOPBACK, is_local


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel layout, validated at start-up: ``data_parallel_size`` engine
    replicas (``server/data_parallel.py``), each sharding the model over
    ``tensor_parallel_size`` ranks."""

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 120.0
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(
                f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective timeout must be positive")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group.

    ``group`` is None at world size 1 (no process group is created then).
    """

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it); never a fixed port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pick_device(local_rank: int, device: str = "auto") -> torch.device:
    """``auto`` is ``cuda:<local_rank>`` when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"rank needs GPU {local_rank} but only {torch.cuda.device_count()} are visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_tp_group(
    rank: int, world_size: int, init_method: str | None, device: torch.device,
    timeout_s: float = 120.0,
) -> TPGroup:
    """Joins (or, at world size 1, skips) the process group.

    ``init_method`` is a ``LocalRendezvous``'s (``file://``: all ranks on this host, gloo
    bound to 127.0.0.1) or e.g. ``tcp://HOST:PORT``; None means the torchrun environment.
    """
    if world_size == 1:
        return TPGroup(0, 1, device, None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict = {"device_id": device} if device.type == "cuda" else {}
    if backend == "gloo" and is_local(init_method):
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        kwargs["pg_options"] = options
    if backend == "nccl" and is_local(init_method):
        os.environ.update(nccl_loopback_env(os.environ))
    dist.init_process_group(
        backend=backend, init_method=init_method or "env://", rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return TPGroup(rank, world_size, device, dist.group.WORLD)


NCCL_LOOPBACK_INTERFACE = "lo"


def nccl_loopback_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that keep NCCL's bootstrap sockets on loopback for a single-host group.

    NCCL exchanges its connection info over TCP sockets on the interface
    ``NCCL_SOCKET_IFNAME`` names, by default the first non-loopback one, so a spawned
    ``serve -tp N`` would listen on the host's network for its lifetime. All ranks of a
    ``LocalRendezvous`` are on this host and talk over NVLink/PCIe (P2P, SHM), so the
    bootstrap can stay on ``lo``. A value the user set is kept (returned unchanged)."""
    if environ.get("NCCL_SOCKET_IFNAME"):
        return {}
    return {"NCCL_SOCKET_IFNAME": NCCL_LOOPBACK_INTERFACE}


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def is_single_host(world_size: int) -> bool:
    """Whether all ``world_size`` ranks run on this host: spawned ranks always do; under
    torchrun, when the local world is the whole world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size


def init_tp_group_from_env(device: str = "auto", timeout_s: float = 120.0) -> TPGroup:
    """Joins the group described by torchrun's environment variables."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError("not launched by torchrun: RANK and WORLD_SIZE are not set")
    rank, world, local = env
    return init_tp_group(rank, world, None, pick_device(local, device), timeout_s)


def destroy_tp_group(group: TPGroup) -> None:
    if group.group is not None and dist.is_initialized():
        dist.destroy_process_group()

"""Small-message all-reduce over peer-to-peer device memory (PyTorch symmetric memory).

A decode step of a tensor-parallel model all-reduces two small hidden states per layer
(8 KiB for one token of an 8B model in bf16). NCCL's ring and tree algorithms cost tens of
microseconds for such messages; reading the peers' buffers directly over NVLink costs a few.

Two algorithms, both NVLink multicast-free (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is
honoured; multicast can take a shared host's GPUs out of service):
- **one-shot**: one kernel copies this rank's input into its symmetric buffer, waits on a
  signal from every peer, then reads all peers' buffers and sums them. Each rank moves
  ``(tp - 1) x size`` bytes: best for small messages.
- **two-shot**: the input is copied into the buffer, each rank reduces ``1/tp`` of it
  (reduce-scatter) and the reduced parts are gathered back. Moves ``2 (tp-1)/tp x size``
  bytes: better for mid-sized messages at tp >= 4.
Messages above ``two_shot_max_bytes`` go to NCCL.

Invariants: the symmetric buffer is allocated once, at start-up, by every rank in the same
order (``rendezvous`` is a collective); its address never changes, so calls are valid inside
CUDA graph capture and replay. A call must be made by every rank of the group, in the same
order, like any collective. The buffer is reused by the next call only after every rank has
passed the previous call's barrier (the kernels signal and wait on each peer).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

REDUCIBLE = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class P2PLimits:
    """Message sizes (bytes) each algorithm takes; measured on 2 H200s (bench/bench_tp.py)."""

    one_shot_max_bytes: int = 512 * 1024
    two_shot_max_bytes: int = 8 * 2**20

    @property
    def buffer_bytes(self) -> int:
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)


class P2PAllReduce:
    """All-reduce of CUDA tensors up to ``limits.buffer_bytes`` through symmetric memory.

    Built by ``create``, which returns None (and logs why) wherever it cannot run: CPU,
    a single rank, a PyTorch without symmetric memory, or peers without P2P access.
    """

    def __init__(self, group_name: str, world_size: int, buffer: torch.Tensor,
                 limits: P2PLimits):
        self.group_name = group_name
        self.world_size = world_size
        self.buffer = buffer  # uint8, symmetric: same size on every rank
        self.limits = limits

    @classmethod
    def create(cls, group: torch.distributed.ProcessGroup | None, world_size: int,
               device: torch.device, single_host: bool,
               limits: P2PLimits | None = None) -> P2PAllReduce | None:
        """Collective over ``group``: every rank calls it at start-up, before any step.

        Ranks ``0..world_size-1`` must sit on GPUs ``0..world_size-1`` of one host."""
        limits = limits or P2PLimits()
        if device.type != "cuda" or world_size == 1 or group is None:
            return None
        if not single_host:
            logger.info("custom all-reduce off: the group spans several hosts")
            return None
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the PyTorch build
            logger.info("custom all-reduce off: no symmetric memory in this PyTorch (%s)", e)
            return None
        if not all(torch.cuda.can_device_access_peer(device.index, d)
                   for d in range(world_size) if d != device.index):
            logger.info("custom all-reduce off: GPUs without peer-to-peer access")
            return None
        return cls.rendezvous(group, world_size, device, limits)

    @classmethod
    def rendezvous(cls, group: torch.distributed.ProcessGroup, world_size: int,
                   device: torch.device, limits: P2PLimits) -> P2PAllReduce:
        """Allocates and exchanges the symmetric buffer (a collective), no checks."""
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        with warnings.catch_warnings():  # required before torch 2.9, deprecated after
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
        buffer = symm_mem.empty(limits.buffer_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, name)
        logger.info("custom all-reduce on: one-shot up to %d KiB, two-shot up to %d KiB, "
                    "NCCL above", limits.one_shot_max_bytes // 1024,
                    limits.two_shot_max_bytes // 1024)
        return cls(name, world_size, buffer, limits)

    def handles(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through this path (else NCCL)."""
        return (x.is_cuda and x.dtype in REDUCIBLE and x.is_contiguous()
                and x.numel() * x.element_size() <= self.limits.two_shot_max_bytes
                and x.numel() % (16 // x.element_size()) == 0)  # 16-byte vector access

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        return self.buffer[:nbytes].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, as a new tensor (``x`` is left unchanged)."""
        out = torch.empty_like(x)
        if x.numel() * x.element_size() <= self.limits.one_shot_max_bytes:
            return torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                self._view(x), x, "sum", self.group_name, out)
        buf = self._view(x)
        buf.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out)

"""Host <-> device copies that never make the host wait for the device: small ones, and
large host buffers page-locked where they are.

The small ones matter under asynchronous scheduling: a pageable copy waits for every step
queued before it, so it would serialize the host with the device it is meant to run ahead
of.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without waiting for the device: on CUDA
    it goes up from pinned memory, non-blocking (a pageable copy would wait for every step
    queued before it, which would undo asynchronous scheduling)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """``t`` on its way to pinned host memory without waiting (CUDA; the reader waits on an
    event recorded after the copy), else ``t`` itself."""
    if t.device.type != "cuda":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def lock_in_place(t: torch.Tensor) -> None:
    """Page-locks host tensor ``t``'s memory where it is (``cudaHostRegister``), so copies
    to and from the device run at full speed: torch's pinned allocator would round the size
    up to a power of two (40 GiB asked, 64 GiB locked) and keep the memory locked after it
    is dropped. ``unlock`` before ``t`` is freed."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0))


def unlock(t: torch.Tensor) -> None:
    """Undoes ``lock_in_place``."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages of ``tensors``, in first-seen order (a storage shared by tied
    or fused tensors counted once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen.setdefault(s._cdata, s)
    return list(seen.values())


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

"""Weights streamed from host memory (``--cpu-offload-gb``, vLLM's flag): the last decoder
layers' weights live in page-locked host memory and are copied into one of two device
staging slots just before their layer runs, so a model larger than the device's memory can
be served, or a smaller one can give the device memory to the KV cache instead.

The copies ride a side stream: layer ``j + 2``'s copy into the slot layer ``j`` used starts
as soon as layer ``j`` has run, and overlaps layers ``j + 1``'s compute. A step's time grows
by about the offloaded bytes over the host link's bandwidth (the copies are repeated every
forward, decode and prefill alike); the start-up log says how much is streamed.

Invariants:
- the offloaded layers are the last ``count`` of the model; they share one layout (as
  many parameter storages, of the same sizes, in the same order), so every one of them
  fits either slot, each storage at its offset (``LayerLayout``); layer
  ``first + i`` runs on slot ``i % 2``, its parameters being views of that slot (their
  identity kept: ``Tensor.set_``), so the layers need no change and a CUDA graph captures
  the copies like any other work (the host buffer never moves);
- a slot is written only after the layer that last read it has run (an event recorded on
  the compute stream after it, waited on by the copy stream), and read only after its copy
  has landed (an event recorded on the copy stream, waited on by the compute stream);
- the forward forks the copy stream from the compute stream at its start and joins it at
  its end, so no copy outlives the forward (the next forward's first copies wait for the
  last reads of this one);
- only parameters are streamed: buffers (KV scales) stay on the device, and LoRA adapters,
  which rebuild the layers' weights, are refused with offloading (``RunnerConfig``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tpserve.model.host_copy import distinct_storages, lock_in_place, storage_bytes, unlock

SLOTS = 2  # double buffering: one slot is read while the other is written
ALIGN = 256  # bytes: each storage's place in a slot starts on this boundary


def _unlock(host: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy still reads it
    unlock(host)


@dataclass(frozen=True)
class LayerLayout:
    """Where a layer's parameter storages sit in a slot: their sizes and byte offsets
    (``ALIGN``-aligned), and the slot's size."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, layer: nn.Module) -> LayerLayout:
        sizes = tuple(s.nbytes() for s in distinct_storages(layer.parameters()))
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += math.ceil(n / ALIGN) * ALIGN
        return cls(sizes, tuple(offsets), at)

    @property
    def weight_bytes(self) -> int:
        return sum(self.sizes)


def offloaded_count(layout: LayerLayout, offload_bytes: int) -> int:
    """How many of the last layers to stream so that the device holds at least
    ``offload_bytes`` fewer bytes of weights: ``count`` layers leave the device, two slots
    come in (at least three, or the slots would save nothing)."""
    # count * weight_bytes - SLOTS * nbytes >= offload_bytes (the slots are ALIGN-padded)
    return max(math.ceil((offload_bytes + SLOTS * layout.nbytes) / layout.weight_bytes),
               SLOTS + 1)


def too_many(layout: LayerLayout, offload_bytes: int, num_layers: int) -> ValueError:
    """The refusal of an ``offload_bytes`` the model's ``num_layers`` cannot give."""
    per_layer = layout.weight_bytes
    most = max(num_layers * per_layer - SLOTS * layout.nbytes, 0)
    return ValueError(
        f"--cpu-offload-gb {offload_bytes / 2**30:g}: the {num_layers} decoder layers hold "
        f"{num_layers * per_layer / 2**30:.2f} GiB a rank, and two of them stay on the "
        f"device as staging slots, so at most {most / 2**30:.2f} GiB can be offloaded")


class LayerWeightStream:
    """The host copies of the last ``count`` layers' weights and the two device slots they
    are streamed into (see the module's invariants). ``start`` / ``before(i)`` /
    ``after(i)`` / ``finish`` bracket a forward and each of its layers; ``close`` gives the
    page-locked host memory back."""

    def __init__(self, layers: nn.ModuleList, first: int, layout: LayerLayout,
                 device: torch.device):
        self.first = first
        self.count = len(layers) - first
        self.layout = layout
        self.device = device
        self.cuda = device.type == "cuda"
        n = layout.nbytes
        self.host = torch.empty(self.count * n, dtype=torch.uint8)
        self._unlock = None
        if self.cuda:
            lock_in_place(self.host)
            # unlocked before the memory is freed, whenever this goes (a later lock of
            # memory mapped at the same place would fail otherwise)
            self._unlock = weakref.finalize(self, _unlock, self.host, device)
        self.host_parts = [self.host[i * n:(i + 1) * n] for i in range(self.count)]
        self.slots = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(self.count)]
            self.freed = [torch.cuda.Event() for _ in range(SLOTS)]

    @property
    def host_bytes(self) -> int:
        return self.host.numel()

    @property
    def device_bytes(self) -> int:
        return SLOTS * self.layout.nbytes

    def take(self, index: int, layer: nn.Module) -> None:
        """Copies layer ``index``'s (on the device, processed) weights into its host part
        and makes its parameters views of its slot. ValueError when its layout is not the
        others'."""
        layout = LayerLayout.of(layer)
        if layout != self.layout:
            raise ValueError(f"--cpu-offload-gb: decoder layer {index}'s weights are laid "
                             "out unlike the last layer's (the model's layers differ, e.g. "
                             "dense and mixture-of-experts layers): only the last layers "
                             "alike can be streamed; offload fewer bytes")
        i = index - self.first
        storages = distinct_storages(layer.parameters())
        part = self.host_parts[i]
        for s, at, size in zip(storages, layout.offsets, layout.sizes, strict=True):
            part[at:at + size].copy_(storage_bytes(s))
        slot = self.slots[i % SLOTS].untyped_storage()
        where = {s._cdata: at for s, at in zip(storages, layout.offsets, strict=True)}
        shared = [n for n, b in layer.named_buffers() if b.untyped_storage()._cdata in where]
        if shared:  # a buffer would keep reading the device copy the layer gives up
            raise ValueError(f"--cpu-offload-gb: decoder layer {index}'s buffers {shared} "
                             "share its weights' memory; this model cannot be offloaded")
        with torch.no_grad():
            for p in layer.parameters():
                at = where[p.untyped_storage()._cdata]  # ALIGN-aligned: a whole element
                p.set_(slot, at // p.element_size() + p.storage_offset(), p.shape, p.stride())

    def start(self) -> None:
        """At a forward's start: the first two offloaded layers' copies begin (on CUDA, on
        the copy stream, after the work queued before this forward)."""
        if not self.cuda:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i in range(min(SLOTS, self.count)):
                self._copy(i)

    def before(self, index: int) -> None:
        """Before layer ``index`` runs: its weights are in its slot."""
        i = index - self.first
        if i < 0:
            return
        if not self.cuda:
            self.slots[i % SLOTS].copy_(self.host_parts[i])
            return
        torch.cuda.current_stream(self.device).wait_event(self.ready[i])

    def after(self, index: int) -> None:
        """After layer ``index`` has been queued: the layer two on is copied into the slot
        it read, once it has run."""
        i = index - self.first
        if not self.cuda or i < 0 or i + SLOTS >= self.count:
            return
        freed = self.freed[i % SLOTS]
        freed.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(freed)
        with torch.cuda.stream(self.stream):
            self._copy(i + SLOTS)

    def finish(self) -> None:
        """At a forward's end: the compute stream joins the copy stream."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _copy(self, i: int) -> None:
        self.slots[i % SLOTS].copy_(self.host_parts[i], non_blocking=True)
        self.ready[i].record(self.stream)

    def close(self) -> None:
        if self._unlock is not None:
            self._unlock()

    def report(self) -> dict:
        """What ``/memory`` says of the streamed layers."""
        return {"layers": [self.first, self.first + self.count - 1],
                "host_bytes": self.host_bytes, "slots": SLOTS,
                "slot_bytes": self.layout.nbytes, "pinned": self.cuda}

    def describe(self) -> str:
        return (f"weights offloaded: the last {self.count} decoder layers "
                f"({self.first}-{self.first + self.count - 1}), "
                f"{self.host_bytes / 2**30:.2f} GiB of {'pinned ' if self.cuda else ''}host "
                f"memory, streamed through {SLOTS} device slots of "
                f"{self.layout.nbytes / 2**20:.1f} MiB each forward")


def resident_weight_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s weights on its device: every parameter, the streamed layers'
    counted as their two slots."""
    stream = model.weight_stream
    if stream is None:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    streamed = {id(p) for layer in model.model.layers[stream.first:]
                for p in layer.parameters()}
    return stream.device_bytes + sum(p.numel() * p.element_size()
                                     for p in model.parameters() if id(p) not in streamed)


def offloadable_bytes(layers: nn.ModuleList) -> int:
    """The most bytes ``--cpu-offload-gb`` could take off the device: the last layers laid
    out alike, less the two slots (0 when fewer than three are alike)."""
    layout = LayerLayout.of(layers[-1])
    alike = 0
    for layer in reversed(layers):
        if LayerLayout.of(layer) != layout:
            break
        alike += 1
    return max(alike * layout.weight_bytes - SLOTS * layout.nbytes, 0) if alike > SLOTS else 0


def place_layers(layers: nn.ModuleList, device: torch.device, offload_bytes: int,
                 process: Callable[[int, nn.Module], None],
                 agree: Callable[[int], int] = lambda count: count) -> LayerWeightStream:
    """Moves the (loaded, host-built) decoder ``layers`` to ``device`` one at a time and
    ``process``es each there (the quantization method's work after loading); the last ones
    stay in host memory, streamed (``LayerWeightStream``), so the device holds at least
    ``offload_bytes`` fewer bytes of weights. Only one streamed layer is on the device at a
    time. The last layer is placed first: its layout decides how many are streamed, and
    the ranks ``agree`` on that count (the largest any of them needs: every rank streams the
    same layers, and all of them refuse together). The resident layers leave host memory
    before the page-locked buffer is taken, so host memory peaks at about twice the
    streamed bytes."""
    n = len(layers)
    last = layers[n - 1].to(device)
    process(n - 1, last)
    layout = LayerLayout.of(last)
    count = agree(offloaded_count(layout, offload_bytes))
    if count > n:
        raise too_many(layout, offload_bytes, n)
    first = n - count
    for i in range(first):
        layers[i].to(device)
        process(i, layers[i])
    stream = LayerWeightStream(layers, first, layout, device)
    try:
        for i in range(first, n):
            if i != n - 1:
                layers[i].to(device)
                process(i, layers[i])
            stream.take(i, layers[i])
    except BaseException:
        stream.close()
        raise
    return stream

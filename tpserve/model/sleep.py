"""Sleep mode on one rank (``--enable-sleep-mode``, vLLM's levels): the device memory of
the weights, the KV pool and the CUDA graphs given back while the engine sleeps, and taken
again at wake-up.

- Level 1: every weight storage is copied to host memory (pinned on CUDA), then emptied;
  wake-up copies it back.
- Level 2: the weights are emptied with no copy kept; wake-up reads the checkpoint into
  the same storages again (``Checkpoint.load_into``). Only a model whose loaded tensors are
  what it serves can: ``level2_refusal`` names the others (quantized at load, LoRA
  adapters beside the weights, a classifier head built from the LM head's rows).
- Both: the KV pool is emptied (its content is gone: the engine resets the prefix cache)
  and the CUDA graphs are dropped; wake-up allocates the pool again, zeroed, and captures
  the graphs again once weights and pool are both back (``tags``: either alone first, as
  vLLM's ``wake_up(tags=...)``).

Invariants:
- a tensor keeps its identity: each storage is resized to 0 bytes and back
  (``UntypedStorage.resize_``), so every view of it (a fused layer's parts, the pool's
  per-layer K and V, tied embeddings, the host tier's view of the pool) sees the new
  memory without being rebuilt. Addresses change, hence the graphs' new capture;
- a storage is whole (awake) or empty (asleep), never partly restored: a wake-up that runs
  out of memory on any rank empties again what it took on every rank and stays asleep;
- only parameters are emptied; buffers (RoPE tables, KV scales) stay, as vLLM keeps them;
- every rank runs the same sleep and wake-up in lockstep (rank 0 broadcasts the command;
  ``ModelRunner.sleep`` / ``wake_up``), so the graphs' capture issues the same collectives
  in the same order everywhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tpserve.model.memory import read_memory

if TYPE_CHECKING:
    from tpserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def level2_refusal(runner: ModelRunner) -> str | None:
    """Why level 2 cannot re-read this model's weights at wake-up, or None if it can."""
    if runner.cfg.quantization != "none":
        return (f"--quantization {runner.cfg.quantization} transforms the weights after "
                "loading")
    if runner.lora is not None:
        return "LoRA adapters are held beside the weights"
    if runner.model_config.classifier_from_token:
        return "the classifier head is built from the LM head's rows at load"
    return None


def _storages(tensors) -> list[torch.UntypedStorage]:
    """The distinct storages of ``tensors``, in first-seen order (a storage shared by tied
    or fused tensors counted once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen.setdefault(s._cdata, s)
    return list(seen.values())


@dataclass
class SleepFigures:
    """What a sleep gave back or a wake-up took, in bytes, and how long it took."""

    weights: int = 0
    kv_cache: int = 0
    graphs: int = 0
    host_copy: int = 0  # level 1: the weights' copy in host memory
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"weights_bytes": self.weights, "kv_cache_bytes": self.kv_cache,
                "cuda_graph_bytes": self.graphs, "host_copy_bytes": self.host_copy,
                "seconds": round(self.seconds, 3)}


class RankSleep:
    """One rank's sleep state: ``level`` (0 awake, else the level it sleeps at) and which
    of the weights and the KV pool are emptied. The runner owns one."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.level = 0
        self.weights_asleep = False
        self.kv_asleep = False
        self._sizes: list[int] = []  # each weight storage's bytes, in ``_weights()`` order
        self._host: list[torch.UntypedStorage] | None = None  # level 1's copies

    def _weights(self) -> list[torch.UntypedStorage]:
        return _storages(self.runner.model.parameters())

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _release_cache(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    # --------------------------------------------------------- every rank, in lockstep
    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (one all-reduce)."""
        r = self.runner
        flag = torch.tensor([int(ok)], dtype=torch.int64, device=r.device)
        return bool(int(r.comm.all_reduce_min(flag).item()))

    def _gathered(self, figures: SleepFigures) -> list[dict[str, float]]:
        """Every rank's figures, in rank order (one all-gather; seconds to the ms)."""
        d = figures.as_dict()
        ints = [int(d[k] * 1000) if k == "seconds" else int(d[k]) for k in d]
        return [{k: (v / 1000 if k == "seconds" else v) for k, v in zip(d, row, strict=True)}
                for row in self.runner._gather_ints(ints)]

    def agreed_sleep(self, level: int) -> list[dict[str, float]]:
        """``sleep`` on every rank once each has made its host copy (level 1); returns
        every rank's figures. MemoryError (every rank still awake) if any rank could not."""
        host, error = None, None
        if level == 1:
            try:
                host = self.host_copies()
            except RuntimeError as e:  # pinned or plain host memory ran out
                error = e
        if not self.all_ok(error is None):
            raise MemoryError(f"sleep level 1: a rank could not copy its weights to host "
                              f"memory ({error or 'another rank'}); still awake")
        return self._gathered(self.sleep(level, host))

    def agreed_wake(self, weights: bool, kv: bool) -> list[dict[str, float]]:
        """``wake`` on every rank, kept only if every rank could (else ``undo`` everywhere
        and MemoryError: as asleep as before); once nothing is asleep, the CUDA graphs are
        captured again. Returns every rank's figures."""
        r = self.runner
        figures, error = self.wake(weights, kv)
        if not self.all_ok(error is None):
            self.undo(weights, kv)
            free, total = read_memory(r.device)
            raise MemoryError(
                f"wake-up: a rank ran out of device memory ({error or 'another rank'}); "
                f"still asleep. Rank {r.comm.rank} has {free / 2**30:.2f} of "
                f"{total / 2**30:.2f} GiB free; the weights need "
                f"{r.plan.weights / 2**30:.2f} GiB and the KV pool "
                f"{r.plan.kv_pool / 2**30:.2f} GiB a rank")
        self.commit(weights, kv)
        if self.level == 0 and r.cfg.uses_cuda_graphs:
            t0 = time.monotonic()
            figures.graphs = r.capture_graphs()
            figures.seconds += time.monotonic() - t0
        return self._gathered(figures)

    # ------------------------------------------------------------------------- sleep
    def host_copies(self) -> list[torch.UntypedStorage]:
        """Level 1, before anything is emptied: every weight storage copied to host memory
        (pinned on CUDA). Raises (having emptied nothing) if host memory runs out."""
        pin = self.runner.device.type == "cuda"
        copies = []
        for s in self._weights():
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            copies.append(host.untyped_storage())
            copies[-1].copy_(s)
        self._sync()
        return copies

    def refusal(self) -> str | None:
        """Why this rank's weights cannot be emptied and taken back in place, or None."""
        fixed = sum(not s.resizable() for s in self._weights())
        if fixed or not self.runner.kv_pool.buffer.untyped_storage().resizable():
            return (f"{fixed} weight storage(s) or the KV pool are not resizable (not "
                    "allocated by torch)")
        return None

    def sleep(self, level: int, host: list[torch.UntypedStorage] | None) -> SleepFigures:
        """Empties the graphs, the weights (``host``: level 1's copies, made first) and the
        KV pool; returns what was given back."""
        t0 = time.monotonic()
        r = self.runner
        self._sync()
        figures = SleepFigures()
        if r.graphs is not None:
            figures.graphs = r.graphs.captured_bytes
            r.graphs = None
        storages = self._weights()
        self._sizes = [s.nbytes() for s in storages]
        for s in storages:
            s.resize_(0)
        figures.weights = sum(self._sizes)
        self._host = host
        figures.host_copy = sum(h.nbytes() for h in host) if host is not None else 0
        figures.kv_cache = r.kv_pool.nbytes
        r.kv_pool.buffer.untyped_storage().resize_(0)
        self._release_cache()
        self.level, self.weights_asleep, self.kv_asleep = level, True, True
        figures.seconds = time.monotonic() - t0
        return figures

    # ------------------------------------------------------------------------- wake
    def wake(self, weights: bool, kv: bool) -> tuple[SleepFigures, BaseException | None]:
        """Takes back the weights and / or the KV pool (those still asleep); returns what
        was taken and the out-of-memory error that stopped it (None if none). On an error
        nothing of this call is kept: the caller agrees with the other ranks and calls
        ``undo`` everywhere if any failed."""
        t0 = time.monotonic()
        figures = SleepFigures()
        try:
            if weights and self.weights_asleep:
                figures.weights = self._restore_weights()
            if kv and self.kv_asleep:
                pool = self.runner.kv_pool
                pool.buffer.untyped_storage().resize_(pool.nbytes)
                pool.buffer.zero_()
                figures.kv_cache = pool.nbytes
        except torch.OutOfMemoryError as e:
            return figures, e
        figures.seconds = time.monotonic() - t0
        return figures, None

    def _restore_weights(self) -> int:
        storages = self._weights()
        for s, size in zip(storages, self._sizes, strict=True):
            s.resize_(size)
        if self._host is not None:
            for s, h in zip(storages, self._host, strict=True):
                s.copy_(h, non_blocking=True)
            self._sync()
        else:  # level 2: the checkpoint again, into the same tensors
            self.runner.ckpt.load_into(self.runner.model, False)
        return sum(self._sizes)

    def undo(self, weights: bool, kv: bool) -> None:
        """Empties again what a failed ``wake(weights, kv)`` took on this rank."""
        if weights and self.weights_asleep:
            for s in self._weights():
                s.resize_(0)
        if kv and self.kv_asleep:
            self.runner.kv_pool.buffer.untyped_storage().resize_(0)
        self._release_cache()

    def commit(self, weights: bool, kv: bool) -> None:
        """Every rank took back what ``wake(weights, kv)`` asked: marks it awake (level 1's
        copies are dropped with the weights' return)."""
        if weights and self.weights_asleep:
            self.weights_asleep = False
            self._host = None
        if kv and self.kv_asleep:
            self.kv_asleep = False
        if not (self.weights_asleep or self.kv_asleep):
            self.level = 0

    def report(self) -> dict[str, object]:
        """The sleep state as the memory report shows it."""
        return {"state": self.state, "level": self.level,
                "weights_asleep": self.weights_asleep, "kv_cache_asleep": self.kv_asleep,
                "host_copy_bytes": sum(h.nbytes() for h in self._host or ())}

    @property
    def state(self) -> str:
        """vLLM's ``engine_sleep_state`` label: awake, weights_offloaded (level 1) or
        discard_all (level 2)."""
        return ("awake" if self.level == 0 else
                "weights_offloaded" if self.level == 1 else "discard_all")

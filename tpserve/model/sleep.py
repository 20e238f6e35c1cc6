"""Sleep mode on one rank (``--enable-sleep-mode``, vLLM's levels): the device memory of
the weights, the KV pool and the CUDA graphs given back while the engine sleeps, and taken
again at wake-up.

- Level 1: every weight storage is copied to host memory (page-locked on CUDA), then emptied;
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
- a storage is whole (awake) or empty (asleep) once a sleep or wake-up has answered: a
  wake-up that fails on any rank (out of memory, a level-2 checkpoint that cannot be
  read, too little room left for the graphs) empties again what it took on every rank and
  stays asleep;
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

from tpserve.model.fault import RELOAD, SLEEP
from tpserve.model.host_copy import distinct_storages, lock_in_place, storage_bytes, unlock
from tpserve.model.memory import read_memory

if TYPE_CHECKING:
    from tpserve.model.loader.checkpoint import Checkpoint
    from tpserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
# vLLM's engine_sleep_state labels, by level (0: awake)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class SleepError(Exception):
    """A sleep or wake-up that did not happen on every rank; every rank is as it was.
    ``out_of_memory``: it failed for want of (device or host) memory."""

    def __init__(self, message: str, out_of_memory: bool):
        super().__init__(message)
        self.out_of_memory = out_of_memory


def level2_refusal(runner: ModelRunner) -> str | None:
    """Why level 2 cannot re-read this model's weights at wake-up, or None if it can."""
    if runner.cfg.quantization != "none":
        return (f"--quantization {runner.cfg.quantization} transforms the weights after "
                "loading")
    if runner.lora is not None:
        return "LoRA adapters are held beside the weights"
    if runner.model.weight_stream is not None:
        return ("--cpu-offload-gb streams the last layers' weights from host memory, which "
                "a load into the served tensors would not reach")
    if runner.model_config.classifier_from_token:
        return "the classifier head is built from the LM head's rows at load"
    return None


class HostCopy:
    """Level 1's copy of a rank's weight storages: one host buffer, page-locked in place on
    CUDA (``host_copy.lock_in_place``). ``close`` gives it back."""

    def __init__(self, storages: list[torch.UntypedStorage], cuda: bool):
        sizes = [s.nbytes() for s in storages]
        self.nbytes = sum(sizes)
        self.buffer: torch.Tensor | None = torch.empty(self.nbytes, dtype=torch.uint8)
        self._registered = False
        if cuda and self.nbytes:
            lock_in_place(self.buffer)
            self._registered = True
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self.parts = [self.buffer[a:b] for a, b in zip(offsets, offsets[1:], strict=False)]
        try:
            for part, s in zip(self.parts, storages, strict=True):
                part.copy_(storage_bytes(s), non_blocking=True)
        except BaseException:
            self.close()
            raise

    def restore(self, storages: list[torch.UntypedStorage]) -> None:
        for part, s in zip(self.parts, storages, strict=True):
            storage_bytes(s).copy_(part, non_blocking=True)

    def close(self) -> None:
        if self._registered:
            unlock(self.buffer)
            self._registered = False
        self.buffer, self.parts = None, []


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
        self._host: HostCopy | None = None  # level 1's copy

    def _weights(self) -> list[torch.UntypedStorage]:
        return distinct_storages(self.runner.model.parameters())

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _release_cache(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def refusal(self) -> str | None:
        """Why this rank's weights cannot be emptied and taken back in place, or None."""
        fixed = sum(not s.resizable() for s in self._weights())
        if fixed or not self.runner.kv_pool.buffer.untyped_storage().resizable():
            return (f"{fixed} weight storage(s) or the KV pool are not resizable (not "
                    "allocated by torch)")
        return None

    # --------------------------------------------------------- every rank, in lockstep
    def _gathered(self, figures: SleepFigures) -> list[dict[str, float]]:
        """Every rank's figures, in rank order (one all-gather; seconds to the ms)."""
        d = figures.as_dict()
        ints = [int(d[k] * 1000) if k == "seconds" else int(d[k]) for k in d]
        return [{k: (v / 1000 if k == "seconds" else v) for k, v in zip(d, row, strict=True)}
                for row in self.runner._gather_ints(ints)]

    def agreed_sleep(self, level: int) -> list[dict[str, float]]:
        """``sleep`` on every rank once each has made its host copy (level 1); returns
        every rank's figures. SleepError (every rank still awake) if any rank could not."""
        host, error = None, None
        if level == 1:
            try:
                if self.runner.fault is not None:
                    self.runner.fault.fire_event(SLEEP)
                host = HostCopy(self._weights(), self.runner.device.type == "cuda")
                self._sync()
            except Exception as e:  # noqa: BLE001 - host memory, registration: agreed below
                error = e
        if not self.runner.comm.all_true(error is None):
            if host is not None:
                host.close()
            raise SleepError(f"sleep level 1: a rank could not copy its weights to host "
                             f"memory ({error or 'another rank'}); still awake", True)
        return self._gathered(self.sleep(level, host))

    def agreed_wake(self, weights: bool, kv: bool,
                    ckpt: Checkpoint | None = None) -> list[dict[str, float]]:
        """``wake`` on every rank, kept only if every rank could, and, where nothing is
        left asleep, had its graphs' reserve free (else ``undo`` everywhere and
        SleepError: as asleep as before); then the CUDA graphs are captured again
        (a capture that still runs out of memory leaves the steps eager, logged).
        ``ckpt``: the weights read from this checkpoint instead (``reload.py``). Returns
        every rank's figures."""
        r = self.runner
        figures, error = self.wake(weights, kv, ckpt)
        graphs = (r.cfg.uses_cuda_graphs and not (self.weights_asleep and not weights)
                  and not (self.kv_asleep and not kv))
        oom = isinstance(error, torch.OutOfMemoryError)
        if error is None and graphs:
            self._release_cache()  # what a level-2 load left cached counts as free
            free, _ = read_memory(r.device)
            if free < r.plan.graphs_reserve:
                oom = True
                error = MemoryError(f"{free / 2**30:.2f} GiB free after the weights and "
                                    f"the pool, the CUDA graphs need about "
                                    f"{r.plan.graphs_reserve / 2**30:.2f} GiB")
        if not self.runner.comm.all_true(error is None):
            self.undo(weights, kv)
            free, total = read_memory(r.device)
            raise SleepError(
                f"wake-up failed on a rank ({error or 'another rank'}); still asleep. Rank "
                f"{r.comm.rank} has {free / 2**30:.2f} of {total / 2**30:.2f} GiB free; the "
                f"weights need {r.plan.weights / 2**30:.2f} GiB and the KV pool "
                f"{r.plan.kv_pool / 2**30:.2f} GiB a rank", oom)
        self.commit(weights, kv)
        if self.level == 0 and r.cfg.uses_cuda_graphs:
            t0 = time.monotonic()
            try:
                figures.graphs = r.capture_graphs()
            except torch.OutOfMemoryError as e:
                r.graphs = None
                self._release_cache()
                logger.warning("rank %d: the CUDA graphs could not be captured again after "
                               "the wake-up (%s); steps run eagerly", r.comm.rank, e)
            figures.seconds += time.monotonic() - t0
        return self._gathered(figures)

    # ------------------------------------------------------------------------- sleep
    def sleep(self, level: int, host: HostCopy | None) -> SleepFigures:
        """Empties the graphs, the weights (``host``: level 1's copy, made first) and the
        KV pool; returns what was given back."""
        t0 = time.monotonic()
        r = self.runner
        self._sync()
        figures = SleepFigures()
        if r.graphs is not None:
            figures.graphs = r.graphs.captured_bytes
            r.graphs = None
        figures.weights = self._empty_weights()
        self._host = host
        figures.host_copy = host.nbytes if host is not None else 0
        figures.kv_cache = r.kv_pool.nbytes
        r.kv_pool.buffer.untyped_storage().resize_(0)
        self._release_cache()
        self.level, self.weights_asleep, self.kv_asleep = level, True, True
        figures.seconds = time.monotonic() - t0
        return figures

    # ------------------------------------------------------------------------- wake
    def wake(self, weights: bool, kv: bool, ckpt: Checkpoint | None = None
             ) -> tuple[SleepFigures, BaseException | None]:
        """Takes back the weights and / or the KV pool (those still asleep); returns what
        was taken and the error that stopped it (None if none: out of memory, or a
        level-2 checkpoint that cannot be read). On an error the caller agrees with the
        other ranks and calls ``undo`` everywhere if any failed."""
        t0 = time.monotonic()
        figures = SleepFigures()
        try:
            if weights and self.weights_asleep:
                figures.weights = self._restore_weights(ckpt)
            if kv and self.kv_asleep:
                pool = self.runner.kv_pool
                pool.buffer.untyped_storage().resize_(pool.nbytes)
                pool.buffer.zero_()
                figures.kv_cache = pool.nbytes
            self._sync()
        except Exception as e:  # noqa: BLE001 - agreed with the other ranks, then undone
            return figures, e
        figures.seconds = time.monotonic() - t0
        return figures, None

    def _restore_weights(self, ckpt: Checkpoint | None) -> int:
        storages = self._weights()
        for s, size in zip(storages, self._sizes, strict=True):
            s.resize_(size)
        if ckpt is not None:  # another checkpoint of the model (reload.py)
            if self.runner.fault is not None:
                self.runner.fault.fire_event(RELOAD)
            ckpt.load_into(self.runner.model, False)
        elif self._host is not None:
            self._host.restore(storages)
        else:  # level 2: the checkpoint again, into the same tensors; a load sets its KV
            # scales, so scales --calculate-kv-scales chose are put back (no reload runs
            # with them: the checkpoint read is the start-up's)
            model = self.runner.model
            calibrated = model.kv_scales() if self.runner.kv_calibration_tokens else None
            self.runner.ckpt.load_into(model, False)
            if calibrated is not None:
                model.set_kv_scales(calibrated)
        return sum(self._sizes)

    def sleep_weights(self, level: int) -> None:
        """This rank's weights emptied again (and the CUDA graphs given back), asleep at
        ``level`` (``level`` 1 keeps no host copy: they wake from the runner's checkpoint):
        a reload that woke them is taken back (``reload.py``). Every rank does the same."""
        self._sync()
        self.runner.graphs = None
        self._empty_weights()
        self._release_cache()
        self.weights_asleep, self.level = True, level

    def _empty_weights(self) -> int:
        """Gives back the weight storages' memory, their sizes kept for the wake-up;
        returns their bytes."""
        storages = self._weights()
        self._sizes = [s.nbytes() for s in storages]
        for s in storages:
            s.resize_(0)
        return sum(self._sizes)

    def undo(self, weights: bool, kv: bool) -> None:
        """Empties again what a failed ``wake(weights, kv)`` took on this rank."""
        self._sync()
        if weights and self.weights_asleep:
            for s in self._weights():
                s.resize_(0)
        if kv and self.kv_asleep:
            self.runner.kv_pool.buffer.untyped_storage().resize_(0)
        self._release_cache()

    def commit(self, weights: bool, kv: bool) -> None:
        """Every rank took back what ``wake(weights, kv)`` asked: marks it awake (level 1's
        copy is given back with the weights' return)."""
        if weights and self.weights_asleep:
            self.weights_asleep = False
            if self._host is not None:
                self._host.close()
                self._host = None
        if kv and self.kv_asleep:
            self.kv_asleep = False
        if not (self.weights_asleep or self.kv_asleep):
            self.level = 0

    def report(self) -> dict[str, object]:
        """The sleep state as the memory report shows it."""
        return {"state": self.state, "level": self.level,
                "weights_asleep": self.weights_asleep, "kv_cache_asleep": self.kv_asleep,
                "host_copy_bytes": self._host.nbytes if self._host is not None else 0}

    @property
    def state(self) -> str:
        """vLLM's ``engine_sleep_state`` label (``SLEEP_STATES``)."""
        return SLEEP_STATES[self.level]

"""Starting and watching rank processes.

``WorkerProcesses`` spawns ranks 1..N-1 of a server (rank 0 is the calling process), all
meeting at a private single-host rendezvous (``LocalRendezvous``), and watches them from a thread: a worker that raises reports its traceback through a queue,
and any worker exit that was not asked for is reported through ``on_failure`` within
``poll_s`` seconds. ``run_ranks`` runs a function on N fresh ranks and returns every
rank's result (tests and one-shot jobs).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tpserve.parallel.rendezvous import LocalRendezvous
from tpserve.parallel.state import TPGroup, destroy_tp_group, init_tp_group, pick_device


def name_this_process(name: str) -> None:
    """Shows ``name`` (at most 15 bytes) as this process's name in ``ps``, ``top`` and
    ``/proc/<pid>/comm`` (the soak's memory report uses it); a no-op off Linux."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w", encoding="utf-8") as f:
            f.write(name[:15])


def _worker_entry(target: Callable[..., Any], rank: int, world_size: int, init_method: str,
                  args: tuple, errors: mp.Queue) -> None:
    name_this_process(f"tpserve-rank{rank}")
    try:
        target(rank, world_size, init_method, *args)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the process exits
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None


class WorkerProcesses:
    """Ranks ``1..world_size-1`` running ``target(rank, world_size, init_method, *args)``;
    rank 0 joins with ``init_method`` too. ``stop`` removes the rendezvous folder."""

    def __init__(self, target: Callable[..., Any], world_size: int,
                 args: tuple, on_failure: Callable[[str], None], poll_s: float = 0.5):
        ctx = mp.get_context("spawn")
        self._rendezvous = LocalRendezvous()
        self.init_method = init_method = self._rendezvous.init_method
        self.errors: mp.Queue = ctx.Queue()
        self.on_failure = on_failure
        self.poll_s = poll_s
        self.procs = [
            ctx.Process(target=_worker_entry, name=f"tpserve-rank{r}", daemon=True,
                        args=(target, r, world_size, init_method, args, self.errors))
            for r in range(1, world_size)
        ]
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rank-watcher", daemon=True)

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self._watcher.start()

    def failure_message(self, timeout: float = 0.0) -> str | None:
        try:
            rank, tb = self.errors.get(timeout=timeout)
        except queue.Empty:
            return None
        return f"rank {rank} failed:\n{tb}"

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive and not self._stopping.is_set():
            ready = mp.connection.wait(list(alive), timeout=self.poll_s)
            for s in ready:
                p = alive.pop(s)
                p.join(timeout=1.0)
                if self._stopping.is_set():
                    return
                msg = self.failure_message(timeout=1.0)
                self.on_failure(msg or f"{p.name} exited unexpectedly (exit code {p.exitcode})")
                return

    def stop(self, timeout: float = 10.0) -> list[int | None]:
        """Waits for the workers to exit (after rank 0 told them to), then kills leftovers."""
        self._stopping.set()
        for p in self.procs:
            p.join(timeout=timeout)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._rendezvous.close()
        return [p.exitcode for p in self.procs]


# what ``run_ranks``' fork server imports once: every rank it starts is a fork of it, so a
# rank starts in milliseconds instead of importing torch again (the server has imported
# nothing else and never touched a device, so a fork of it is as clean as a spawn)
FORKSERVER_PRELOAD = ("torch", "tpserve.parallel.launch")


def _rank_context() -> Any:
    """The ``forkserver`` context, its server (one per calling process, started by the
    first call) preloading ``FORKSERVER_PRELOAD``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _run_rank(fn: Callable[..., Any], rank: int, world_size: int, init_method: str,
              args: tuple, results: mp.Queue, device: str, env: dict[str, str]) -> None:
    # the caller's environment now, not the fork server's (from its start), as a spawned
    # process would have it
    os.environ.clear()
    os.environ.update(env)
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        group = init_tp_group(rank, world_size, init_method, pick_device(rank, device))
        try:
            out = fn(group, *args)
        finally:
            destroy_tp_group(group)
        # plain pickle: tensors travel by value, not as shared-memory handles that die
        # with this process
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the caller
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 300.0, device: str = "cpu") -> list[Any]:
    """Runs ``fn(group: TPGroup, *args)`` on ``world_size`` fresh ranks (CPU and gloo, or
    ``device="cuda"``: rank r on GPU r with NCCL) and returns the results in rank order.
    Raises with the failing rank's traceback, or on timeout; never hangs. The ranks are
    forks of a fork server (``_rank_context``), so ``fn`` and ``args`` travel pickled, and
    the caller's environment at this call is the ranks', as with spawned processes.
    """
    ctx = _rank_context()
    results: mp.Queue = ctx.Queue()
    rendezvous = LocalRendezvous()
    procs = [ctx.Process(target=_run_rank, daemon=True,
                         args=(fn, r, world_size, rendezvous.init_method, args, results,
                               device, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"ranks did not finish within {timeout_s} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
        rendezvous.close()
    return [out[r] for r in range(world_size)]


__all__ = ["TPGroup", "WorkerProcesses", "run_ranks"]

"""``EngineProxy``: the HTTP process's handle on the engine process (``--engine-process``).

It implements ``EngineClient`` (plus ``start``/``shutdown``/``fail``/``drain`` for
``serve``) with the same validation, backpressure and errors as ``AsyncEngine`` (both are
``EngineFront``s), but the engine runs in a child process (``engine_process``; the message
protocol is described there).

Ownership in this process: the event loop thread owns the request table (request id ->
``asyncio.Queue``) and the query table (query id -> future; ``EngineFront.query``) and
sends commands; one reader thread owns the output pipe and the
child's exit: it receives every message and hands each "out" message to the event loop
with ONE ``call_soon_threadsafe``, keeps the latest stats, and turns "dead", EOF or the
child's exit (unless ``shutdown`` asked for it) into ``fail``. ``fail`` marks the engine
dead (/health 503, new requests 503), ends every registered request with
``EngineDeadError`` and calls ``on_fatal`` (which stops the HTTP server; ``serve`` then
exits 1). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
from collections.abc import Callable
from typing import Any

from tpserve.model.loader.checkpoint import open_checkpoint
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.config import Config
from tpserve.server.engine.errors import EngineDeadError
from tpserve.server.engine.front import EngineFront, TurnBatch, settle
from tpserve.server.engine.step_loop import dead_error
from tpserve.server.engine_process import run_engine_process
from tpserve.server.replicas import ONLY, Replica

logger = logging.getLogger("tpserve")

POLL_S = 1.0  # how often the waits re-check the child


class PipeTransport:
    """``EngineTransport`` to the engine process: commands go down the command pipe (one
    lock for the HTTP thread and ``drain``'s), the requests of one event loop turn in one
    "add" message (``TurnBatch``: every other command flushes it first); the request table
    (request id -> ``asyncio.Queue``) and the event loop the outputs go to belong to the
    event loop thread. ``is_alive`` looks at the reader thread and the child's sentinel,
    not ``is_alive()``: only the reader thread reaps the child. An "add" that cannot be
    sent is not an error here: the engine process is gone, and the reader thread's
    ``fail`` ends every registered request."""

    def __init__(self, commands: mp.connection.Connection, proc: Any,
                 reader: threading.Thread) -> None:
        self.commands = commands
        self.proc = proc
        self.reader = reader
        self.queues: dict[str, asyncio.Queue] = {}
        self.answers: dict[int, asyncio.Future] = {}  # query id -> its asker's future
        self.loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        self._adds = TurnBatch(lambda adds: self._send(("add", adds)))

    def send(self, msg: tuple) -> bool:
        """False when the engine process is gone."""
        self._adds.flush()
        return self._send(msg)

    def _send(self, msg: tuple) -> bool:
        with self._send_lock:
            try:
                self.commands.send(msg)
                return True
            except (OSError, ValueError):  # the engine process is gone
                return False

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue) -> None:
        if not self.is_alive():
            raise EngineDeadError("engine is dead: the engine process is gone")
        self.loop = asyncio.get_running_loop()
        self.queues[request_id] = outputs
        self._adds.add((request_id, list(prompt_token_ids), params))

    def release(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self.send(("abort", request_id))

    def abort_all(self) -> None:
        self.send(("abort_all",))

    def has_requests(self) -> bool:
        return bool(self.queues)

    def query(self, query_id: int, name: str | tuple, answer: asyncio.Future) -> None:
        self.loop = asyncio.get_running_loop()
        self.answers[query_id] = answer
        if not self.send(("query", query_id, name)):
            del self.answers[query_id]
            raise EngineDeadError("engine is dead: the engine process is gone")

    def forget_query(self, query_id: int) -> None:
        self.answers.pop(query_id, None)

    def is_alive(self) -> bool:
        return (self.reader.is_alive()
                and not mp.connection.wait([self.proc.sentinel], timeout=0))


class EngineProxy(EngineFront):
    """Spawns the engine process and waits until it is ready (raises its start-up error,
    e.g. ``MemoryError`` when the model does not fit); ``start`` starts reading its
    outputs. ``replica``: which data-parallel replica it is (``data_parallel.py``)."""

    def __init__(self, cfg: Config, on_fatal: Callable[[str], None] | None = None,
                 replica: Replica = ONLY):
        r = cfg.runner
        # no weights are read here: the checkpoint is opened for its tokenizer (and so a
        # missing model fails before a process is spawned)
        ckpt = open_checkpoint(r.model, r.load_format, r.seed, r.hf_overrides, r.tokenizer,
                               r.disable_sliding_window, r.generation_config)
        self.dead_reason: str | None = None
        self._on_fatal = on_fatal
        self._stats: dict[str, float] = {}
        self._stopping = threading.Event()
        ctx = mp.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._outputs, out_send = ctx.Pipe(duplex=False)
        # not a daemon: it spawns the worker ranks itself
        self.replica = replica
        self._proc = ctx.Process(target=run_engine_process, name="tpserve-engine",
                                 args=(cfg, cmd_recv, out_send, replica))
        self._proc.start()
        cmd_recv.close()  # the child's ends: its exit then shows as EOF here
        out_send.close()
        self._reader = threading.Thread(target=self._read, name="engine-reader",
                                        daemon=True)
        self._pipe = PipeTransport(self._commands, self._proc, self._reader)
        try:
            tokenizer = ckpt.tokenizer()
            info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._stats = info["stats"]
        self.info = info
        self._init_front(self._pipe, cfg.served_model_name, info["max_model_len"], tokenizer,
                         info["vocab_size"], cfg.scheduler.max_num_seqs,
                         cfg.scheduler.max_num_batched_tokens,
                         cfg.engine.max_num_queued_requests, cfg.engine.max_num_queued_tokens,
                         frozenset(info["eos_token_ids"]))
        logger.info("%s process %d ready: %s, tp %d on %s%s, %d KV blocks", replica.name,
                    self._proc.pid, info["model"], info["tp"], info["device"],
                    "" if replica.visible_devices is None
                    else f" (CUDA_VISIBLE_DEVICES={replica.visible_devices})",
                    info["kv_blocks"])

    def _wait_ready(self) -> dict[str, Any]:
        while True:
            ready = mp.connection.wait([self._outputs, self._proc.sentinel], timeout=POLL_S)
            if self._outputs in ready:
                try:
                    kind, arg = self._outputs.recv()
                except EOFError:
                    ready = [self._proc.sentinel]
                else:
                    if kind == "ready":
                        return arg
                    self._proc.join(timeout=10.0)
                    raise arg  # "failed": the start-up error itself
            if self._proc.sentinel in ready:
                self._proc.join(timeout=10.0)
                raise RuntimeError(f"the engine process exited during start-up "
                                   f"(exit code {self._proc.exitcode})")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._reader.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops accepting, tells the engine process to stop (it tells the workers) and
        waits for it; kills it after ``timeout`` s."""
        self.accepting = False
        self._stopping.set()
        self._pipe.send(("shutdown",))
        if self._reader.is_alive() or self._reader.ident is None:
            if self._reader.ident is None:
                self._reader.start()  # it reaps the child
            self._reader.join(timeout=timeout)
        if self._reader.is_alive():
            logger.error("the %s process did not exit within %.0f s; killing it",
                         self.replica.name, timeout)
            self._proc.kill()
            self._reader.join(timeout=10.0)

    def _kill(self) -> None:
        self._stopping.set()
        self._proc.kill()
        self._proc.join(timeout=10.0)

    def fail(self, reason: str) -> None:
        """Called from any thread: the engine is dead, every request ends with an error."""
        if self.dead_reason is not None:
            return
        logger.error("%s failed: %s", self.replica.name, reason)
        self.dead_reason = reason
        self.accepting = False
        loop = self._pipe.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed already
                loop.call_soon_threadsafe(self._fail_all, dead_error(reason))
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def _fail_all(self, error: EngineDeadError) -> None:
        for q in list(self._pipe.queues.values()):
            q.put_nowait(error)
        for answer in list(self._pipe.answers.values()):
            settle(answer, None, error)

    # ---------------------------------------------------------------- HTTP side
    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    # ---------------------------------------------------------------- reader thread
    def _read(self) -> None:
        conn, sentinel = self._outputs, self._proc.sentinel
        try:
            while True:
                ready = mp.connection.wait([conn, sentinel], timeout=POLL_S)
                if conn in ready:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        break
                    self._handle(msg)
                elif sentinel in ready:
                    break
        finally:
            self._proc.join(timeout=10.0)
            if not self._stopping.is_set():
                self.fail(f"the {self.replica.name} process exited unexpectedly "
                          f"(exit code {self._proc.exitcode})")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, items, stats = msg
            if stats is not None:
                self._stats = stats
            loop = self._pipe.loop
            if items and loop is not None:
                with contextlib.suppress(RuntimeError):  # the event loop is closed already
                    loop.call_soon_threadsafe(self._dispatch, items)
        elif kind == "reply":
            loop = self._pipe.loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # the event loop is closed already
                    loop.call_soon_threadsafe(self._answer, *msg[1:])
        elif kind == "dead":
            self.fail(msg[1])
        else:
            logger.warning("unexpected message from the engine process: %r", kind)

    def _answer(self, query_id: int, value: Any, error: BaseException | None) -> None:
        """Event loop thread: a query's reply to its asker, if it still waits."""
        answer = self._pipe.answers.get(query_id)
        if answer is not None:
            settle(answer, value, error)

    def _dispatch(self, items: list[tuple[str, Any]]) -> None:
        """Event loop thread: one step's outputs to their requests' queues."""
        for request_id, item in items:
            q = self._pipe.queues.get(request_id)
            if q is not None:
                q.put_nowait(item)

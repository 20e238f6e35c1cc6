"""The engine in its own process (``--engine-process``), like vLLM v1's engine core: the
HTTP process (``engine_proxy.EngineProxy``) and the engine then hold one GIL each.

Ownership: this process is rank 0. It spawns and watches ranks 1..N-1 (``startup``),
owns the ``ModelRunner``, the ``EngineCore`` and the ``StepLoop`` (the engine thread),
and a command-reader thread that turns pipe messages into the loop's inbox. The HTTP
process owns the sockets, the tokenizer it needs for prompts, and every request's
``asyncio.Queue``; it never touches the model.

Messages, over two one-way ``multiprocessing`` pipes (pickled tuples):

HTTP -> engine (commands, in the order the HTTP side issued them)
  ("add", [(request_id, prompt_token_ids, SamplingParams), ...])
                               the requests of one event loop turn, admitted together
  ("abort", request_id)        idempotent; unknown ids are ignored
  ("abort_all",)               drain's deadline passed: every request ends with "abort"
  ("query", query_id, name)    an engine query (``engine/queries.py``), answered by one
                               "reply" with the same id after the step in flight
  ("shutdown",)                end the loop: requests still running end with
                               EngineShuttingDownError, workers get CMD_SHUTDOWN, exit 0

engine -> HTTP
  first, exactly one of:
  ("ready", info)              info: max_model_len, vocab_size, model, tp, device,
                               kv_blocks, stats
  ("failed", exception)        start-up raised (the exception itself when it pickles,
                               else a RuntimeError with its traceback); then exit 1
  then, any number of:
  ("out", [(request_id, RequestOutput | EngineError), ...], stats | None)
                               one message per engine step with every output of that
                               step, in emission order (outputs of failure fan-out from
                               other threads come one per message); stats at most every
                               STATS_INTERVAL_S, and always when the engine went idle,
                               and on idle heartbeats (every HEARTBEAT_S)
  ("reply", query_id, value, error)
                               a query's answer (error None) or its error (value None;
                               an ``EngineError`` or a picklable stand-in); the HTTP side
                               drops a reply whose asker timed out
  ("dead", reason)             a worker rank died or a step raised: every request in
                               flight has been sent its EngineDeadError (before this
                               message, or right after when the engine thread was mid-step);
                               the process exits 1 within a few seconds

On death: if this process dies without a word (killed, ``os._exit``), the HTTP side sees
the pipe's EOF / the process sentinel and fails every request itself. If the HTTP
process goes away (the command pipe closes), the loop stops as on "shutdown".
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from tpserve.model.fault import FAULT_ENV, replica_fault_spec
from tpserve.parallel.launch import name_this_process
from tpserve.server.config import Config
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.step_loop import HEARTBEAT_S, Item, Reply, StepLoop, engine_stats
from tpserve.server.failure import LateBoundFailure
from tpserve.server.replicas import ONLY, Replica
from tpserve.server.startup import build_engine_core, join_group, leave_group

logger = logging.getLogger("tpserve")

STATS_INTERVAL_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEAD_GRACE_S = 2.0  # how long a dead engine's thread may take to leave its step


class PipeOutbox:
    """Engine-process delivery (``engine.Outbox``): targets are request ids; one "out"
    message per step. ``send`` is thread-safe and never raises: if the HTTP process is
    gone, the command reader stops the loop."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.core: EngineCore | None = None  # set once built: stats come from it
        self._lock = threading.Lock()
        self._last_stats = 0.0
        self._idle_sent = False

    def send(self, msg: tuple) -> None:
        with self._lock:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(msg)

    def send_now(self, target: Any, item: Item) -> None:
        self.send(("out", [(target, item)], None))

    def send_reply(self, query_id: int, value: Any, error: BaseException | None) -> None:
        """A query's answer, after the stats as they are now: a query may change them (a
        pause, a sleep), and the asker may read /metrics as soon as it has the answer."""
        if self.core is not None and threading.current_thread().name == "engine":
            self.send(("out", [], engine_stats(self.core)))
        self.send(("reply", query_id, value, None if error is None else _picklable(error)))

    def send_step(self, batch: list[tuple[Any, Item]], idle: bool) -> None:
        now = time.monotonic()
        stats = None
        due = now - self._last_stats >= STATS_INTERVAL_S
        # when the engine goes idle the stats always go along: they are then current
        # once a client has its last output (kv usage back to 0, nothing running)
        if self.core is not None and (due or (idle and (batch or not self._idle_sent))):
            stats = engine_stats(self.core)
            self._last_stats = now
            self._idle_sent = idle
        elif not idle:
            self._idle_sent = False
        if batch or stats is not None:
            self.send(("out", batch, stats))


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` when it survives a round trip through pickle, else a RuntimeError with its
    traceback (so ValueError/MemoryError keep their type: the CLI exits 2 on them)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling problem
        return RuntimeError("".join(traceback.format_exception(exc)))


def _replier(outbox: PipeOutbox, query_id: int) -> Reply:
    """The reply callback of one query: its answer down the output pipe."""

    def reply(value: Any, error: BaseException | None) -> None:
        outbox.send_reply(query_id, value, error)

    return reply


def _read_commands(conn: Connection, steps: StepLoop, outbox: PipeOutbox) -> None:
    """Command reader thread: pipe messages -> the step loop's inbox."""
    while steps.is_alive():
        try:
            if not conn.poll(HEARTBEAT_S):
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            logger.warning("the HTTP process went away; stopping the engine")
            steps.request_stop()
            return
        kind = msg[0]
        if kind == "add":
            steps.submit([RequestState(rid, prompt, params, steps.emitter(rid))
                          for rid, prompt, params in msg[1]])
        elif kind == "abort":
            steps.abort(msg[1])
        elif kind == "abort_all":
            steps.abort_all()
        elif kind == "query":
            _, query_id, name = msg
            steps.query(name, _replier(outbox, query_id))
        elif kind == "shutdown":
            steps.request_stop()
            return


def run_engine_process(cfg: Config, commands: Connection, outputs: Connection,
                       replica: Replica = ONLY) -> None:
    """Entry point of the engine process (``multiprocessing`` spawn target); exits with
    status 0 after a requested shutdown, 1 after a failure. A data-parallel ``replica``
    sees only its own GPUs (``replicas.py``), and on the CPU takes its share of the
    cores."""
    if replica.visible_devices is not None:  # before CUDA starts; its ranks inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = replica.visible_devices
    if replica.count > 1 and os.environ.get(FAULT_ENV):  # the test hook, for its ranks
        os.environ[FAULT_ENV] = replica_fault_spec(
            os.environ[FAULT_ENV], replica.index, cfg.parallel.tensor_parallel_size)
    if replica.count > 1 and cfg.runner.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (
            replica.count * cfg.parallel.tensor_parallel_size)))
    name_this_process("tpserve-engine" if replica.count == 1
                      else f"tpserve-engine{replica.index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the HTTP process's to handle
    logging.basicConfig(level=cfg.server.log_level.upper(), format=LOG_FORMAT)
    code = 1
    try:
        code = _run(cfg, commands, outputs, replica.index)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # as the CLI does: no interpreter finalization around gloo groups or an engine
        # thread still blocked in a collective with a dead rank
        os._exit(code)


def _run(cfg: Config, commands: Connection, outputs: Connection, replica: int) -> int:
    outbox = PipeOutbox(outputs)
    on_worker_failure = LateBoundFailure()  # bound to the StepLoop once it exists
    group = workers = None
    try:
        group, workers = join_group(cfg, on_worker_failure)
        core = build_engine_core(cfg, group, replica)
        if early := on_worker_failure.early():
            raise RuntimeError(early[0])
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process
        if not isinstance(e, (ValueError, FileNotFoundError, MemoryError)):
            # the CLI prints just the message of those; of anything else, the traceback
            logger.error("engine start-up failed", exc_info=True)
        early = on_worker_failure.early()
        error = RuntimeError(early[0]) if early else _picklable(e)
        outbox.send(("failed", error))
        leave_group(group, workers)
        return 1
    steps = StepLoop(core, outbox, lambda reason: outbox.send(("dead", reason)))
    outbox.core = core
    r = core.runner
    outbox.send(("ready", {
        "max_model_len": core.max_model_len, "vocab_size": r.model_config.vocab_size,
        "model": r.ckpt.description, "tp": r.comm.world_size, "device": str(r.device),
        "kv_blocks": r.kv_pool.num_blocks, "eos_token_ids": sorted(core.eos_token_ids),
        "stats": engine_stats(core)}))
    steps.start()
    died = on_worker_failure.bind(steps.fail)  # its on_fatal sends "dead"
    if died:
        steps.fail(died[0])
    reader = threading.Thread(target=_read_commands, args=(commands, steps, outbox),
                              name="engine-commands", daemon=True)
    reader.start()
    while steps.is_alive() and steps.dead_reason is None:
        steps.join(timeout=0.5)
    steps.join(timeout=DEAD_GRACE_S)  # after a failure it may be stuck in a collective
    leave_group(group, workers)
    return 1 if steps.dead_reason is not None else 0

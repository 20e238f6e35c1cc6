"""``tpserve serve``: start the ranks, plan memory, build the engine, serve HTTP.

Rank 0 is this process; with ``--tensor-parallel-size N`` it spawns ranks 1..N-1 itself,
or, under torchrun, every process runs this and ranks > 0 become workers. A rank that
dies or raises is reported within seconds: requests end with errors, /health turns 503,
and the process exits non-zero so that a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import torch
import uvicorn

from tpserve.model.runner import ModelRunner, run_worker
from tpserve.parallel.launch import WorkerProcesses
from tpserve.parallel.state import (
    TPGroup,
    destroy_tp_group,
    find_free_port,
    init_tp_group,
    init_tp_group_from_env,
    pick_device,
    torchrun_env,
)
from tpserve.server.app import build_app
from tpserve.server.config import Config
from tpserve.server.engine import AsyncEngine
from tpserve.server.engine_core import EngineCore

logger = logging.getLogger("tpserve")


class _Exit:
    """The process's exit status, set once by whoever notices a fatal failure first."""

    def __init__(self):
        self.code = 0
        self.reason: str | None = None
        self.lock = threading.Lock()

    def fatal(self, reason: str) -> None:
        with self.lock:
            if self.code == 0:
                self.code, self.reason = 1, reason


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM/SIGINT stop serving through our
    handler, so a clean shutdown exits 0 (uvicorn would re-raise the signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _join_group(cfg: Config, on_worker_failure) -> tuple[TPGroup, WorkerProcesses | None]:
    tp = cfg.parallel.tensor_parallel_size
    timeout = cfg.parallel.collective_timeout_s
    env = torchrun_env()
    if env is not None:
        if env[1] != tp:
            raise ValueError(f"torchrun started {env[1]} processes but "
                             f"--tensor-parallel-size is {tp}")
        return init_tp_group_from_env(cfg.runner.device, timeout), None
    device = pick_device(0, cfg.runner.device)
    if tp == 1:
        return TPGroup(0, 1, device, None), None
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    workers = WorkerProcesses(run_worker, tp, init_method, (cfg.runner, timeout),
                              on_failure=on_worker_failure)
    workers.start()
    return init_tp_group(0, tp, init_method, device, timeout), workers


def serve(cfg: Config) -> int:
    status = _Exit()
    holder: dict[str, object] = {}

    def on_worker_failure(reason: str) -> None:
        status.fatal(reason)
        engine = holder.get("engine")
        if isinstance(engine, AsyncEngine):
            engine.fail(reason)  # calls on_fatal, which stops the HTTP server
        else:
            logger.error("a worker failed during start-up: %s", reason)

    group, workers = _join_group(cfg, on_worker_failure)
    try:
        if group.rank != 0:
            torch.set_num_threads(max(1, torch.get_num_threads() // group.world_size))
            ModelRunner(cfg.runner, group).worker_loop()
            return 0
        return _serve_rank0(cfg, group, workers, status, holder)
    finally:
        if workers is not None:
            workers.stop(timeout=10.0)
        destroy_tp_group(group)


def _serve_rank0(cfg: Config, group: TPGroup, workers: WorkerProcesses | None,
                 status: _Exit, holder: dict) -> int:
    runner = ModelRunner(cfg.runner, group, show_progress=True)
    for line in runner.plan.describe():
        logger.info(line)
    logger.info("kernels: %s; tensor parallel size %d; start-up took %.1f s",
                runner.ops.name, group.world_size, runner.startup_s)
    tokenizer = runner.ckpt.tokenizer()
    core = EngineCore(runner, tokenizer, enable_prefix_caching=cfg.engine.enable_prefix_caching,
                      seed=cfg.runner.seed, check_integrity=cfg.engine.check_integrity,
                      async_scheduling=cfg.engine.async_scheduling,
                      max_mixed_tokens=cfg.engine.max_mixed_tokens)
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        status.fatal(reason)
        if server is not None:
            server.should_exit = True

    name = cfg.served_model_name
    engine = AsyncEngine(core, name, on_fatal,
                         max_queued_requests=cfg.engine.max_num_queued_requests,
                         max_queued_tokens=cfg.engine.max_num_queued_tokens)
    holder["engine"] = engine
    app = build_app(engine, served_model_names=(name,), api_key=cfg.server.api_key,
                    max_request_body_bytes=cfg.server.max_request_body_bytes)
    server = _Server(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, log_level=cfg.server.log_level,
        timeout_graceful_shutdown=5, access_log=False))
    draining = threading.Event()

    def drain_then_exit() -> None:
        clean = engine.drain(cfg.server.shutdown_timeout_s)
        logger.info("drained: %s", "all requests finished" if clean
                    else "requests still running were aborted")
        server.should_exit = True

    def on_signal(signum, _frame) -> None:
        if draining.is_set():  # a second signal: stop now
            server.should_exit = True
            return
        draining.set()
        logger.info("signal %d: no new requests; draining for up to %.0f s", signum,
                    cfg.server.shutdown_timeout_s)
        threading.Thread(target=drain_then_exit, name="drain", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    engine.start()
    logger.info("serving %s on http://%s:%d", name, cfg.server.host, cfg.server.port)
    try:
        server.run()
    finally:
        engine.shutdown(timeout=10.0)
    if status.code:
        logger.error("exiting with status %d: %s", status.code,
                     (status.reason or "").splitlines()[0] if status.reason else "")
    return status.code

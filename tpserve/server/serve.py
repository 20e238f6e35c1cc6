"""``tpserve serve``: start the ranks, plan memory, build the engine, serve HTTP.

Rank 0 is this process; with ``--tensor-parallel-size N`` it spawns ranks 1..N-1 itself,
or, under torchrun, every process runs this and ranks > 0 become workers. A rank that
dies or raises is reported within seconds: requests end with errors, /health turns 503,
and the process exits non-zero so that a supervisor restarts it.

With ``--engine-process`` (not under torchrun) rank 0's engine runs in a child process
instead (``engine_process``; it spawns ranks 1..N-1), and this process only serves HTTP
through an ``EngineProxy``; failures and shutdown behave the same. With
``--data-parallel-size N`` there are N such engine processes (``data_parallel``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import torch
import uvicorn

from tpserve.model.generation_config import (
    GenerationDefaults,
    resolve_generation_defaults,
    with_overrides,
)
from tpserve.model.runner import ModelRunner
from tpserve.parallel.launch import WorkerProcesses
from tpserve.parallel.state import TPGroup, torchrun_env
from tpserve.server.config import Config
from tpserve.server.data_parallel import DataParallelEngines
from tpserve.server.engine.step_loop import AsyncEngine
from tpserve.server.engine_proxy import EngineProxy
from tpserve.server.exposure import exposure_warning
from tpserve.server.failure import LateBoundFailure
from tpserve.server.http.app import build_app
from tpserve.server.port import check_port_free
from tpserve.server.startup import build_engine_core, join_group, leave_group
from tpserve.server.stats_log import StatsLogger

logger = logging.getLogger("tpserve")


class _Exit:
    """The process's exit status, set once by whoever notices a fatal failure first; a
    fatal failure also stops the HTTP server once there is one."""

    def __init__(self):
        self.code = 0
        self.reason: str | None = None
        self.lock = threading.Lock()
        self.server: uvicorn.Server | None = None

    def fatal(self, reason: str) -> None:
        with self.lock:
            if self.code == 0:
                self.code, self.reason = 1, reason
            if self.server is not None:
                self.server.should_exit = True


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM/SIGINT stop serving through our
    handler, so a clean shutdown exits 0 (uvicorn would re-raise the signal)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def serve(cfg: Config) -> int:
    env = torchrun_env()
    if env is None or env[0] == 0:  # rank 0 serves HTTP
        check_port_free(cfg.server.host, cfg.server.port)
        warning = exposure_warning(cfg.server.host, cfg.server.port, cfg.server.api_key)
        if warning is not None:
            logger.warning(warning)
    defaults = with_overrides(
        resolve_generation_defaults(cfg.server.generation_config, cfg.runner.model,
                                    cfg.runner.load_format),
        dict(cfg.server.generation_overrides))
    if cfg.engine.engine_process and env is None:
        return _serve_engine_process(cfg, defaults)
    status = _Exit()
    on_worker_failure = LateBoundFailure(always=status.fatal)
    group, workers = join_group(cfg, on_worker_failure)
    try:
        if group.rank != 0:
            torch.set_num_threads(max(1, torch.get_num_threads() // group.world_size))
            ModelRunner(cfg.runner, cfg.scheduler.limits, group).worker_loop()
            return 0
        return _serve_rank0(cfg, group, workers, status, on_worker_failure, defaults)
    finally:
        leave_group(group, workers)


def _serve_rank0(cfg: Config, group: TPGroup, workers: WorkerProcesses | None,
                 status: _Exit, on_worker_failure: LateBoundFailure,
                 defaults: GenerationDefaults) -> int:
    core = build_engine_core(cfg, group)
    engine = AsyncEngine(core, cfg.served_model_name, status.fatal,
                         max_queued_requests=cfg.engine.max_num_queued_requests,
                         max_queued_tokens=cfg.engine.max_num_queued_tokens)
    # failures before this only set the exit status (``always``), as during start-up
    on_worker_failure.bind(engine.fail)  # fail calls on_fatal, which stops the HTTP server
    return _serve_http(cfg, engine, status, defaults)


def _serve_engine_process(cfg: Config, defaults: GenerationDefaults) -> int:
    status = _Exit()
    # both raise the engine's start-up error
    engine = (EngineProxy(cfg, status.fatal) if len(cfg.replicas) == 1
              else DataParallelEngines(cfg, status.fatal))
    return _serve_http(cfg, engine, status, defaults)


def _serve_http(cfg: Config, engine: AsyncEngine | EngineProxy | DataParallelEngines,
                status: _Exit,
                defaults: GenerationDefaults) -> int:
    """Runs uvicorn over ``engine`` until a signal (drain first) or a fatal failure; then
    shuts the engine down. Returns the exit status."""
    name = cfg.served_model_name
    if cfg.runner.pooler is not None:  # sampling defaults mean nothing to embeddings
        logger.info("serving %s (--runner pooling): %s", cfg.runner.pooler.routes,
                    cfg.runner.pooler.describe())
    else:
        logger.info(defaults.describe())
    app = build_app(engine, served_model_names=(name, *cfg.server.served_model_aliases),
                    unlisted_model_names=cfg.server.unlisted_model_names,
                    api_key=cfg.server.api_key,
                    max_request_body_bytes=cfg.server.max_request_body_bytes,
                    default_sampling_params=defaults.params,
                    log_requests=cfg.server.log_requests,
                    chat_template=cfg.server.chat_template,
                    auto_tool_parser=(cfg.server.tool_call_parser
                                      if cfg.server.enable_auto_tool_choice else None),
                    reasoning_parser=cfg.server.reasoning_parser,
                    priority_scheduling=cfg.scheduler.policy == "priority",
                    cors=cfg.server.cors,
                    lora_modules=cfg.runner.lora.modules if cfg.runner.lora else (),
                    download_dir=cfg.server.download_dir,
                    response_role=cfg.server.response_role,
                    max_logprobs=cfg.server.max_logprobs,
                    root_path=cfg.server.root_path,
                    docs=not cfg.server.disable_fastapi_docs,
                    pooler=cfg.runner.pooler,
                    metrics_namespace=cfg.server.metrics_namespace,
                    frontend=cfg.server.frontend)
    server = _Server(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, timeout_graceful_shutdown=5,
        access_log=False, **cfg.server.uvicorn_options()))
    with status.lock:
        status.server = server
        server.should_exit = status.code != 0  # a worker failed before serving began
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
    stats_log = None
    if cfg.server.log_stats_interval_s is not None:
        stats_log = StatsLogger(engine.stats, cfg.server.log_stats_interval_s)
        stats_log.start()
    logger.info("serving %s on %s://%s:%d%s", name, cfg.server.scheme, cfg.server.host,
                cfg.server.port, cfg.server.root_path or "")
    try:
        server.run()
    finally:
        if stats_log is not None:
            stats_log.stop()
        engine.shutdown(timeout=10.0)
    if status.code:
        logger.error("exiting with status %d: %s", status.code,
                     (status.reason or "").splitlines()[0] if status.reason else "")
    return status.code

"""The async front of the engine: the HTTP side submits, streams and aborts requests; the
model runs in the engine's own thread, so the event loop never waits on it.

Three pieces, shared by the in-process engine (``AsyncEngine``) and the engine process
(``engine_process`` + ``engine_proxy.EngineProxy``):

- ``EngineFront`` (``front``): what the HTTP side checks before a request reaches the
  engine (validation, backpressure with 429, drain); it reaches this module's loop through
  ``StepLoopTransport``.
- ``StepLoop``: the engine thread. ``EngineCore`` and everything under it belong to it;
  other threads talk to it only through its inbox (add / abort / abort_all / query / stop)
  and read plain counters. A query (``queries``) is answered between steps through the
  reply callback it came with. Idle (or only waiting for grammar compiles: ``step``
  returned without sending a step), it sends heartbeats (``CMD_NOOP``) to the worker
  ranks; at the end, ``CMD_SHUTDOWN``, and the core's grammar compiler is closed; a step
  that raises kills the engine (``fail``).
- ``Outbox``: where outputs go. Outputs emitted on the engine thread are collected per
  step and handed over in one ``send_step`` call (one wake-up of the consumer per step,
  less GIL ping-pong); outputs emitted on any other thread (failure fan-out) go at once
  through ``send_now``. In process, the targets are ``(event loop, asyncio.Queue)`` pairs
  and delivery is ``loop.call_soon_threadsafe``; in the engine process they are request
  ids and delivery is one pipe message per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tpserve.model.memory import allocator_stats
from tpserve.model.plan import CMD_NOOP, CMD_SHUTDOWN
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineShuttingDownError,
)
from tpserve.server.engine.front import EngineFront, TurnBatch, settle
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.pause import Deferred
from tpserve.server.engine.queries import run_query
from tpserve.server.engine.request_state import RequestState

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0

Item = RequestOutput | BaseException
# a query's answer: ``reply(value, None)`` or ``reply(None, error)``, called once
Reply = Callable[[Any, BaseException | None], None]


def engine_stats(core: EngineCore) -> dict[str, Any]:
    """The core's counters plus the device allocator's readings (what /metrics exports),
    and under ``"memory"`` the memory report (``MemoryMonitor.report``: nested, what
    /memory serves and the per-rank memory metrics read)."""
    s: dict[str, Any] = dict(core.stats())
    mem = allocator_stats(core.runner.device)
    s["device_memory_allocated_bytes"] = mem["allocated"]
    s["device_memory_reserved_bytes"] = mem["reserved"]
    s["allocator_segments"] = mem["segments"]
    s["memory"] = core.memory.report()
    return s


def dead_error(reason: str) -> EngineDeadError:
    """The error every in-flight request ends with when the engine fails."""
    return EngineDeadError(f"engine failed: {reason.splitlines()[0]}")


class Outbox(Protocol):
    """Delivers the step loop's outputs to their consumers."""

    def send_now(self, target: Any, item: Item) -> None:
        """One output, at once; called from threads other than the engine thread."""

    def send_step(self, batch: list[tuple[Any, Item]], idle: bool) -> None:
        """Once per loop iteration on the engine thread, with that iteration's outputs
        (possibly none); ``idle`` when no request is left."""


class StepLoop:
    """The engine thread around an ``EngineCore`` (see the module docstring)."""

    def __init__(self, core: EngineCore, outbox: Outbox,
                 on_fatal: Callable[[str], None] | None = None):
        self.core = core
        self.outbox = outbox
        self.dead_reason: str | None = None
        self._on_fatal = on_fatal
        self._inbox: queue.Queue = queue.Queue()
        self._pending: list[tuple[Any, Item]] = []
        # queries answered after steps have run (``pause.Deferred``: a pause that waits)
        self._deferred: list[tuple[str, Deferred, Reply]] = []
        self._deferred_lock = threading.Lock()  # ``fail`` empties it from another thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def request_stop(self) -> None:
        """Ends the loop after the current step: running requests end with
        ``EngineShuttingDownError`` and the workers are told to exit."""
        self._stop.set()
        self._inbox.put(("wake", None))

    def emitter(self, target: Any) -> Callable[[Item], None]:
        """A ``RequestState.emit`` delivering to ``target`` through the outbox."""

        def emit(item: Item) -> None:
            if threading.current_thread() is self._thread:
                self._pending.append((target, item))  # sent once per step
            else:
                self.outbox.send_now(target, item)

        return emit

    def submit(self, states: list[RequestState]) -> None:
        """Admits ``states`` together: one inbox item, so the engine thread never starts a
        step with only some of them."""
        self._inbox.put(("add", states))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        self._inbox.put(("abort_all", None))

    def query(self, name: str | tuple, reply: Reply) -> None:
        """``queries.run_query(name)`` on the engine thread after the step in flight;
        ``reply`` is called there once with the answer or the error (from the failing
        thread when the engine dies first; never when the loop stopped without failing:
        the asker's timeout covers that)."""
        self._inbox.put(("query", (name, reply)))

    @property
    def has_requests(self) -> bool:
        return bool(self.core.requests)

    def stats(self) -> dict[str, float]:
        return engine_stats(self.core)

    def fail(self, reason: str) -> None:
        """Called from any thread when a rank died or a step raised: the engine is dead
        first (so /health fails before anyone sees an error), then every request ends
        with ``EngineDeadError``, then ``on_fatal``."""
        if self.dead_reason is not None:
            return
        logger.error("engine failed: %s", reason)
        self.dead_reason = reason
        self._inbox.put(("fail", reason))
        self._stop.set()
        # The engine thread may be stuck in a collective with the dead rank: end the
        # requests from here too (emit is thread-safe, and done states are skipped).
        error = dead_error(reason)
        for state in list(self.core.requests.values()):
            if not state.done:
                state.done = True
                state.emit(error)
        while True:  # requests still in the inbox were never registered: end them too
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                for state in arg:
                    if not state.done:
                        state.done = True
                        state.emit(error)
            elif kind == "query":
                arg[1](None, error)
        self._fail_deferred(error)
        if self._on_fatal is not None:
            self._on_fatal(reason)

    # ----------------------------------------------------------- engine thread
    def _drain(self, block: bool) -> None:
        try:
            kind, arg = self._inbox.get(timeout=HEARTBEAT_S) if block else \
                self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                for state in arg:
                    if self.dead_reason is not None or state.done:
                        state.emit(EngineDeadError("engine is dead"))
                    else:
                        self._add(state)
            elif kind == "abort":
                self.core.abort(arg)
            elif kind == "abort_all":
                for rid in list(self.core.requests):
                    self.core.abort(rid)
            elif kind == "query":
                self._answer(*arg)
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _answer(self, name: str, reply: Reply) -> None:
        """Runs one query. Its refusal (``EngineError``) goes back to the asker; anything
        else (a collective that failed) is reported to the asker, then kills the engine
        like a failed step."""
        if self.dead_reason is not None:
            reply(None, EngineDeadError("engine is dead"))
            return
        self._reply(name, reply, lambda: run_query(self.core, name))

    def _reply(self, name: str, reply: Reply, answer: Callable[[], Any]) -> None:
        """Replies with ``answer()``, or defers it (a ``Deferred``: ``_settle_deferred``
        after each step)."""
        try:
            value = answer()
        except EngineError as e:
            reply(None, e)
            return
        except BaseException as e:
            reply(None, EngineError(f"engine query {name!r} failed: {e!r}"))
            raise
        if isinstance(value, Deferred):
            with self._deferred_lock:
                self._deferred.append((name, value, reply))
            self._settle_deferred()
        else:
            self._flush()  # outputs the query emitted (a pause's aborts) go out before it
            reply(value, None)

    def _settle_deferred(self) -> None:
        """Answers the deferred queries that are ready, in the order they came (one
        called off answers at once, whatever came before it)."""
        while True:
            with self._deferred_lock:
                ready = next((d for d in self._deferred if d[1].ready()), None)
                if ready is None:
                    return
                self._deferred.remove(ready)
            name, deferred, reply = ready
            self._reply(name, reply, deferred.finish)

    def _fail_deferred(self, error: BaseException) -> None:
        """Answers every deferred query with ``error`` (the engine stops or died); any
        thread."""
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, []
        for _, _, reply in deferred:
            reply(None, error)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self.outbox.send_step(batch, not self.core.wants_step)

    def _add(self, state: RequestState) -> None:
        """Admits one request; a failure there ends that request only."""
        try:
            self.core.add(state)
        except Exception as e:  # noqa: BLE001 - isolate the request, keep the engine
            logger.exception("could not add request %s", state.request_id)
            self.core.abort(state.request_id)
            state.done = True
            state.emit(EngineError(f"could not start the request: {e!r}"))

    def _run(self) -> None:
        last_sent = time.monotonic()
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.wants_step)
                if self._stop.is_set():
                    break
                if self.core.wants_step and self.core.step():
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= HEARTBEAT_S:
                    # idle, or only waiting (for grammars): the workers still hear from us
                    self.core.runner.send_command(CMD_NOOP)
                    last_sent = time.monotonic()
                if self.core.memory.sample(self.core.block_manager.usage):
                    last_sent = time.monotonic()  # a gather reached every rank
                self._flush()
                if self._deferred:  # after the outputs of the requests it waited for
                    self._settle_deferred()
            if self.dead_reason is None:
                self._fail_deferred(EngineShuttingDownError("server shut down"))
                self.core.fail_all(EngineShuttingDownError("server shut down"))
                self._flush()
                self.core.runner.send_command(CMD_SHUTDOWN)
        except BaseException as e:  # noqa: BLE001 - any step failure kills the engine
            logger.exception("engine step failed")
            self.fail(f"engine step failed: {e!r}")
            self.core.fail_all(EngineDeadError(f"engine step failed: {e!r}"))
            self._flush()
        finally:
            self.core.close()  # the grammar compiler's worker


class _LoopOutbox:
    """In-process delivery: targets are ``(event loop, asyncio.Queue)`` pairs."""

    def send_now(self, target: tuple[asyncio.AbstractEventLoop, asyncio.Queue],
                 item: Item) -> None:
        loop, q = target
        loop.call_soon_threadsafe(q.put_nowait, item)

    def send_step(self, batch: list, idle: bool) -> None:
        """One ``call_soon_threadsafe`` per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for (loop, q), item in batch:
            by_loop.setdefault(loop, []).append((q, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


class StepLoopTransport:
    """``EngineTransport`` to a ``StepLoop`` in this process: requests go into its inbox
    with an emitter to the caller's event loop and queue."""

    def __init__(self, steps: StepLoop) -> None:
        self.steps = steps
        self._adds = TurnBatch(steps.submit)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue) -> None:
        emit = self.steps.emitter((asyncio.get_running_loop(), outputs))
        self._adds.add(RequestState(request_id, list(prompt_token_ids), params, emit))

    def release(self, request_id: str) -> None:
        """Nothing to do: the loop drops a request's state when it finishes."""

    def abort(self, request_id: str) -> None:
        self._adds.flush()
        self.steps.abort(request_id)

    def abort_all(self) -> None:
        self._adds.flush()
        self.steps.abort_all()

    def has_requests(self) -> bool:
        return self.steps.has_requests

    def query(self, query_id: int, name: str | tuple, answer: asyncio.Future) -> None:
        if not self.steps.is_alive():
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()

        def reply(value: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed already
                loop.call_soon_threadsafe(settle, answer, value, error)

        self._adds.flush()
        self.steps.query(name, reply)

    def forget_query(self, query_id: int) -> None:
        """Nothing to do: a late reply finds its future done."""

    def is_alive(self) -> bool:
        return self.steps.is_alive()


class AsyncEngine(EngineFront):
    """Implements ``EngineClient`` for the HTTP layer, with the engine thread in this
    process."""

    def __init__(self, core: EngineCore, model_name: str,
                 on_fatal: Callable[[str], None] | None = None, *,
                 max_queued_requests: int = 1024, max_queued_tokens: int = 1 << 20):
        self.core = core
        self._on_fatal = on_fatal
        self.steps = StepLoop(core, _LoopOutbox(), self._fatal)
        self._init_front(StepLoopTransport(self.steps), model_name, core.max_model_len,
                         core.tokenizer, core.runner.model_config.vocab_size,
                         core.scheduler.config.max_num_seqs, core.max_num_batched_tokens,
                         max_queued_requests, max_queued_tokens, core.eos_token_ids)

    @property
    def dead_reason(self) -> str | None:
        return self.steps.dead_reason

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.steps.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops accepting, ends the loop, tells the workers to exit."""
        self.accepting = False
        self.steps.request_stop()
        self.steps.join(timeout)

    def fail(self, reason: str) -> None:
        """Called from any thread when a rank died: every request ends with an error."""
        self.steps.fail(reason)

    def _fatal(self, reason: str) -> None:
        self.accepting = False
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def stats(self) -> dict[str, float]:
        return self.steps.stats()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def describe(engine: AsyncEngine) -> dict[str, Any]:
    """A one-line summary for logs."""
    r = engine.core.runner
    return {"model": engine.model_name, "tp": r.comm.world_size, "device": str(r.device),
            "kv_blocks": r.kv_pool.num_blocks, "max_model_len": engine.max_model_len}

"""The async front of the engine: the HTTP side submits, streams and aborts requests; the
model runs in the engine's own thread, so the event loop never waits on it.

Thread ownership: ``EngineCore`` and everything under it belong to the engine thread.
Other threads talk to it only through ``_inbox`` (add / abort) and read plain counters.
Outputs cross back to the event loop with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tpserve.model.memory import allocator_stats
from tpserve.model.plan import CMD_NOOP, CMD_SHUTDOWN
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine_core import EngineCore
from tpserve.server.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    EngineShuttingDownError,
    InvalidRequestError,
    PromptTooLongError,
)
from tpserve.server.outputs import RequestOutput
from tpserve.server.request_state import RequestState

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0


class AsyncEngine:
    """Implements ``EngineClient`` for the HTTP layer."""

    def __init__(self, core: EngineCore, model_name: str,
                 on_fatal: Callable[[str], None] | None = None, *,
                 max_queued_requests: int = 1024, max_queued_tokens: int = 1 << 20):
        self.core = core
        self.model_name = model_name
        self.max_model_len = core.max_model_len
        self.tokenizer = core.tokenizer
        self.vocab_size = core.runner.model_config.vocab_size
        self.accepting = True
        self.dead_reason: str | None = None
        self._on_fatal = on_fatal
        # backpressure: requests (and their prompt tokens) accepted but not yet finished,
        # beyond what one step can run; touched only on the event loop thread
        self.max_outstanding = core.scheduler.config.max_num_seqs + max_queued_requests
        self.max_outstanding_tokens = max_queued_tokens + core.max_num_batched_tokens
        self.outstanding = 0
        self.outstanding_tokens = 0
        self._inbox: queue.Queue = queue.Queue()
        # outputs of the current step, handed to the event loop in one call per step:
        # one wake-up of the loop instead of one per request (less GIL ping-pong)
        self._pending: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def is_healthy(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops accepting, ends the loop, tells the workers to exit."""
        self.accepting = False
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=timeout)

    def fail(self, reason: str) -> None:
        """Called from any thread when a rank died: every request ends with an error."""
        if self.dead_reason is not None:
            return
        logger.error("engine failed: %s", reason)
        self.dead_reason = reason
        self.accepting = False
        self._inbox.put(("fail", reason))
        self._stop.set()
        # The engine thread may be stuck in a collective with the dead rank: end the
        # requests from here too (emit is thread-safe, and done states are skipped).
        error = EngineDeadError(f"engine failed: {reason.splitlines()[0]}")
        for state in list(self.core.requests.values()):
            if not state.done:
                state.done = True
                state.emit(error)
        while True:  # requests still in the inbox were never registered: end them too
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and not arg.done:
                arg.done = True
                arg.emit(error)
        if self._on_fatal is not None:
            self._on_fatal(reason)

    # ---------------------------------------------------------------- HTTP side
    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason.splitlines()[0]}")
        if not self.accepting:
            raise EngineShuttingDownError("server is shutting down")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt)} prompt tokens and max_tokens={params.max_tokens} "
                f"({len(prompt) + params.max_tokens} in total)")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self._validate(prompt_token_ids, params)
        if (self.outstanding >= self.max_outstanding
                or self.outstanding_tokens + len(prompt_token_ids) > self.max_outstanding_tokens):
            raise EngineOverloadedError(
                f"server is at capacity ({self.outstanding} requests, "
                f"{self.outstanding_tokens} prompt tokens queued or running); retry later",
                retry_after=1)
        self.outstanding += 1
        self.outstanding_tokens += len(prompt_token_ids)
        try:
            async for out in self._generate(request_id, prompt_token_ids, params):
                yield out
        finally:
            self.outstanding -= 1
            self.outstanding_tokens -= len(prompt_token_ids)

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def emit(item: RequestOutput | BaseException) -> None:
            if threading.current_thread() is self._thread:
                self._pending.append((loop, outputs, item))  # flushed once per step
            else:
                loop.call_soon_threadsafe(outputs.put_nowait, item)

        state = RequestState(request_id, list(prompt_token_ids), params, emit)
        self._inbox.put(("add", state))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def drain(self, timeout: float) -> bool:
        """Stops accepting, waits up to ``timeout`` s for in-flight requests to finish,
        then aborts the rest (their clients get finish_reason ``abort``). Returns True when
        everything finished on its own."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.core.requests and time.monotonic() < deadline and self.is_healthy():
            time.sleep(0.05)
        clean = not self.core.requests
        self._inbox.put(("abort_all", None))
        while self.core.requests and self.is_healthy() and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        return clean

    def stats(self) -> dict[str, float]:
        s = dict(self.core.stats())
        mem = allocator_stats(self.core.runner.device)
        s["device_memory_allocated_bytes"] = mem["allocated"]
        s["device_memory_reserved_bytes"] = mem["reserved"]
        s["allocator_segments"] = mem["segments"]
        return s

    # -------------------------------------------------------------- engine thread
    def _drain(self, block: bool) -> None:
        try:
            kind, arg = self._inbox.get(timeout=HEARTBEAT_S) if block else \
                self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                if self.dead_reason is not None or arg.done:
                    arg.emit(EngineDeadError("engine is dead"))
                else:
                    self._add(arg)
            elif kind == "abort":
                self.core.abort(arg)
            elif kind == "abort_all":
                for rid in list(self.core.requests):
                    self.core.abort(rid)
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _flush(self) -> None:
        """Delivers the step's outputs: one ``call_soon_threadsafe`` per event loop."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, item in batch:
            by_loop.setdefault(loop, []).append((q, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _add(self, state: RequestState) -> None:
        """Admits one request; a failure there ends that request only."""
        try:
            self.core.add(state)
        except Exception as e:  # noqa: BLE001 - isolate the request, keep the engine
            logger.exception("could not add request %s", state.request_id)
            self.core.abort(state.request_id)
            state.done = True
            state.emit(EngineError(f"could not start the request: {e!r}"))

    def _loop(self) -> None:
        last_sent = time.monotonic()
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.has_unfinished)
                if self._stop.is_set():
                    break
                if self.core.has_unfinished:
                    self.core.step()
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent >= HEARTBEAT_S:
                    self.core.runner.send_command(CMD_NOOP)
                    last_sent = time.monotonic()
                self._flush()
            if self.dead_reason is None:
                self.core.fail_all(EngineShuttingDownError("server shut down"))
                self._flush()
                self.core.runner.send_command(CMD_SHUTDOWN)
        except BaseException as e:  # noqa: BLE001 - any step failure kills the engine
            logger.exception("engine step failed")
            # dead first, then tell the clients: /health is 503 before anyone sees the error
            self.fail(f"engine step failed: {e!r}")
            self.core.fail_all(EngineDeadError(f"engine step failed: {e!r}"))
            self._flush()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def describe(engine: AsyncEngine) -> dict[str, Any]:
    """A one-line summary for logs."""
    r = engine.core.runner
    return {"model": engine.model_name, "tp": r.comm.world_size, "device": str(r.device),
            "kv_blocks": r.kv_pool.num_blocks, "max_model_len": engine.max_model_len}

"""``EngineFront``: what the HTTP side checks before a request reaches the engine
(validation, backpressure with 429, drain), and the ``EngineTransport`` through which it
reaches the engine: ``StepLoopTransport`` (``step_loop``, the engine thread in this
process) or ``PipeTransport`` (``engine_proxy``, the engine in a child process).

The front's counters are touched only on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShuttingDownError,
    EngineTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
)
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.queries import QUERY_TIMEOUT_S


class EngineTransport(Protocol):
    """How an ``EngineFront`` reaches its engine. Called on the event loop thread, except
    ``is_alive``, ``has_requests`` and ``abort_all`` (also from ``drain``'s thread)."""

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               outputs: asyncio.Queue) -> None:
        """Starts the request; its outputs (or the error ending it) arrive in ``outputs``.
        Requests submitted in one turn of the event loop reach the engine together
        (``TurnBatch``), so one engine step can start them all. Raises ``EngineError``
        (and has registered nothing) when it knows it cannot start; a failure found when
        the batch goes out ends the request through ``outputs``."""

    def release(self, request_id: str) -> None:
        """The consumer of ``request_id`` is gone (finished, failed or stopped early)."""

    def abort(self, request_id: str) -> None:
        """Ends the request early (its consumer gets finish_reason ``abort``)."""

    def abort_all(self) -> None:
        """Aborts every request the engine has."""

    def has_requests(self) -> bool:
        """Whether any request is still registered."""

    def query(self, query_id: int, name: str | tuple, answer: asyncio.Future) -> None:
        """Asks the engine ``name`` (``queries``); the answer or its error is set on
        ``answer`` on this event loop (unless ``answer`` is done already). Raises
        ``EngineError`` (and has registered nothing) when it cannot ask."""

    def forget_query(self, query_id: int) -> None:
        """The asker stopped waiting (answered or timed out): a late reply is dropped."""

    def is_alive(self) -> bool:
        """Whether the engine (thread or process) still runs; ``is_healthy`` is this and
        no ``dead_reason``."""


class EngineFront:
    """The HTTP side of an engine: validation, backpressure, the per-request output
    queue, drain. Subclasses provide ``dead_reason`` and call ``_init_front`` with the
    ``EngineTransport`` that reaches their engine."""

    dead_reason: str | None

    def _init_front(self, transport: EngineTransport, model_name: str, max_model_len: int,
                    tokenizer: Any,
                    vocab_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                    max_queued_requests: int, max_queued_tokens: int,
                    eos_token_ids: frozenset[int]) -> None:
        self.transport = transport
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.accepting = True
        # jobs of several requests in flight (beam searches: ``job``), which drain waits
        # for, and whether their requests still pass while draining
        self.jobs = 0
        self.admit_jobs = True
        # backpressure: requests (and their prompt tokens, times n) accepted but not yet
        # finished, beyond what one step can run; touched only on the event loop thread
        self.max_outstanding = max_num_seqs + max_queued_requests
        self.max_outstanding_tokens = max_queued_tokens + max_num_batched_tokens
        self.outstanding = 0
        self.outstanding_tokens = 0
        # their sequences (n each, as vLLM's child requests): the load data-parallel
        # routing compares (``data_parallel``)
        self.outstanding_seqs = 0
        # its data-parallel rank (``data_parallel``), stamped on its outputs for the HTTP
        # metrics' ``engine`` label
        self.engine_index = 0
        self._query_ids = itertools.count()

    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.transport.is_alive()

    def abort(self, request_id: str) -> None:
        self.transport.abort(request_id)

    def pinned(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineFront:
        """``EngineClient.pinned``: one engine is its own."""
        return self

    def at_rank(self, rank: int) -> EngineFront:
        """``EngineClient.at_rank``: one engine is data-parallel rank 0."""
        return check_rank(self, rank, 1)

    def fits(self, prompt_len: int, params: SamplingParams) -> bool:
        """Whether backpressure lets a request of ``prompt_len`` tokens (``params.n``
        sequences) in now: fewer requests than the most, and room for its prompt tokens
        times n."""
        return (self.outstanding < self.max_outstanding
                and self.outstanding_tokens + prompt_len * params.n
                <= self.max_outstanding_tokens)

    @contextlib.contextmanager
    def job(self) -> Iterator[None]:
        """``EngineClient.job``: a job of several requests over time (a beam search's
        steps) that a drain lets finish, as it lets a request finish: refused (503) once
        draining; while it runs, drain waits for it, and its requests
        (``generate(..., in_job=True)``) pass until drain's timeout."""
        if not self.accepting:
            raise EngineShuttingDownError("server is shutting down")
        self.jobs += 1
        try:
            yield
        finally:
            self.jobs -= 1

    def _validate(self, prompt: list[int], params: SamplingParams, in_job: bool = False
                  ) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason.splitlines()[0]}")
        if not self.accepting and not (in_job and self.admit_jobs):
            raise EngineShuttingDownError("server is shutting down")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})")
        if params.pooling is not None:  # nothing is generated: the prompt alone
            if len(prompt) > self.max_model_len:
                raise PromptTooLongError(
                    f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the input has {len(prompt)} tokens")
        elif len(prompt) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt)} prompt tokens and max_tokens={params.max_tokens} "
                f"({len(prompt) + params.max_tokens} in total)")

    async def query(self, name: str | tuple, timeout: float = QUERY_TIMEOUT_S) -> Any:
        """The engine's answer to the query ``name`` (``queries``; a tuple: its name, then
        its arguments), asked between steps;
        raises the query's own ``EngineError``, ``EngineDeadError``, or
        ``EngineTimeoutError`` after ``timeout`` s."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_reason.splitlines()[0]}")
        query_id = next(self._query_ids)
        answer = asyncio.get_running_loop().create_future()
        self.transport.query(query_id, name, answer)
        try:
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise EngineTimeoutError(f"the engine did not answer {name!r} within "
                                     f"{timeout:.0f} s") from None
        finally:
            self.transport.forget_query(query_id)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, admitted: Callable[[], None] | None = None,
                       in_job: bool = False) -> AsyncIterator[RequestOutput]:
        """``EngineClient.generate``; ``admitted`` (data parallelism's) is called once the
        request passed validation and backpressure, before it is submitted."""
        self._validate(prompt_token_ids, params, in_job)
        # each of the n sibling sequences holds the whole prompt (their K/V is shared only
        # while the prefix cache keeps it), so the request counts n times its prompt
        tokens = len(prompt_token_ids) * params.n
        if tokens > self.max_outstanding_tokens:  # not even an idle engine lets it in
            raise InvalidRequestError(
                f"this request's n x prompt tokens ({params.n} x {len(prompt_token_ids)} = "
                f"{tokens}) exceed what this server admits at once "
                f"({self.max_outstanding_tokens}: --max-num-queued-tokens + "
                "--max-num-batched-tokens); a retry cannot succeed")
        if not self.fits(len(prompt_token_ids), params):
            raise EngineOverloadedError(
                f"server is at capacity ({self.outstanding} requests, "
                f"{self.outstanding_tokens} prompt tokens queued or running; this request "
                f"adds {tokens} = n x prompt tokens); retry later", retry_after=1)
        if admitted is not None:
            admitted()
        self.outstanding += 1
        self.outstanding_seqs += params.n
        self.outstanding_tokens += tokens
        try:
            async for out in self._generate(request_id, prompt_token_ids, params):
                yield out
        finally:
            self.outstanding -= 1
            self.outstanding_seqs -= params.n
            self.outstanding_tokens -= tokens

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams) -> AsyncIterator[RequestOutput]:
        outputs: asyncio.Queue = asyncio.Queue()
        self.transport.submit(request_id, prompt_token_ids, params, outputs)
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                item.engine_index = self.engine_index
                yield item
                if finished:
                    return
        finally:
            self.transport.release(request_id)
            if not finished:
                self.abort(request_id)

    def drain(self, timeout: float) -> bool:
        """Stops accepting, waits up to ``timeout`` s for in-flight requests to finish,
        then aborts the rest (their clients get finish_reason ``abort``); a paused or
        sleeping engine (``--enable-sleep-mode``) finishes nothing, so they are aborted at
        once. A job in flight (``job``: a beam search) is waited for too, its next
        requests let in until the timeout. Returns True when everything finished on its
        own."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while ((self.transport.has_requests() or self.jobs) and time.monotonic() < deadline
               and self.is_healthy() and not self.stats().get("engine_paused")):
            time.sleep(0.05)
        clean = not self.transport.has_requests() and not self.jobs
        self.admit_jobs = False
        self.transport.abort_all()
        while self.transport.has_requests() and self.is_healthy() and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        return clean


class TurnBatch:
    """Requests submitted in one turn of the event loop, handed to ``deliver`` as one list
    at the end of that turn. The engine then admits them together: without this, the
    first of a beam search step's requests (``http/beam_search``) woke an idle engine and
    often ran a step alone.

    Invariant: a command sent after ``add`` reaches the engine after the requests added
    before it, because every other command calls ``flush`` first (an abort must never
    overtake its request). ``add`` is called on the event loop thread; ``flush`` on any
    thread; ``deliver`` runs under the lock, so two flushes cannot reorder their lists."""

    def __init__(self, deliver: Callable[[list], None]) -> None:
        self._deliver = deliver
        self._items: list = []
        self._lock = threading.Lock()

    def add(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            if len(self._items) == 1:
                asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            if items:
                self._deliver(items)


def check_rank(engine: Any, rank: int, size: int) -> Any:
    """``engine``, unless ``rank`` is outside the ``size`` data-parallel ranks: then
    InvalidRequestError (400), as vLLM answers an ``X-data-parallel-rank`` out of range."""
    if not 0 <= rank < size:
        raise InvalidRequestError(f"data_parallel_rank {rank} is out of range [0, {size}).")
    return engine


def settle(answer: asyncio.Future, value: Any, error: BaseException | None) -> None:
    """Event loop thread: a query's reply onto its future, unless it is done already
    (timed out, cancelled)."""
    if answer.done():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(value)

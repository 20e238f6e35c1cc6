"""The interface the HTTP layer needs from the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.outputs import RequestOutput
from tpserve.server.engine.queries import QUERY_TIMEOUT_S


class EngineClient(Protocol):
    """What ``build_app`` drives; the engine implements it.

    ``generate`` is an async generator: it raises ``EngineError`` subclasses (before the
    first output or while running), yields one ``RequestOutput`` per step with a delta for
    each sibling that advanced, and its last output has ``finished=True`` and the usage
    counts. If the consumer stops early (``aclose()`` or task cancellation) the engine
    aborts the request itself. ``abort`` must be idempotent and ignore unknown ids.
    """

    model_name: str
    max_model_len: int
    vocab_size: int  # the width of the model's logits (token ids the sampler knows)
    eos_token_ids: frozenset[int]  # the ids that end a sequence unless ignore_eos
    tokenizer: Any
    accepting: bool
    dead_reason: str | None

    def is_healthy(self) -> bool: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        in_job: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """``in_job``: a request of a ``job`` in flight, let in while draining."""
        ...

    def job(self) -> AbstractContextManager[None]:
        """A job of several requests over time (a beam search's steps, on its ``pinned``
        engine) that a drain lets finish as it lets a request finish: refused with
        ``EngineShuttingDownError`` once draining; while it runs, drain waits for it and
        its requests (``in_job``) pass until drain's timeout."""
        ...

    def abort(self, request_id: str) -> None: ...

    def pinned(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineClient:
        """The engine a job of several requests over one prompt (a beam search) sends all
        of them to, so they share one prefix cache: this engine, or the data-parallel
        replica a request of that prompt would go to (``server/data_parallel.py``)."""
        ...

    def at_rank(self, rank: int) -> EngineClient:
        """The engine of data-parallel rank ``rank`` (vLLM's ``X-data-parallel-rank``
        header, ``data_parallel_rank``): that replica, which then takes the request
        without routing (one engine is rank 0); InvalidRequestError (400) for a rank
        outside ``[0, --data-parallel-size)``."""
        ...

    def stats(self) -> dict[str, float]: ...

    async def query(self, name: str | tuple, timeout: float = QUERY_TIMEOUT_S) -> Any:
        """The engine's answer to a query (``server/engine/queries.py``), asked between
        steps; raises ``EngineError`` (the query's refusal, a dead engine, no answer in
        ``timeout`` s)."""


def data_parallel_rank(headers: Mapping[str, str]) -> int | None:
    """The request's ``X-data-parallel-rank`` header as vLLM reads it
    (``_get_data_parallel_rank``): its integer, None where it is absent or no integer."""
    value = headers.get("X-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None

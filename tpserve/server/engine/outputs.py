"""What the engine hands back to the HTTP layer, one delta per step and sibling."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives (token id, decoded text,
    logprob); ``rank`` (1 = the most likely token) where known (a scored prompt token)."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class CompletionDelta:
    """New output of sibling ``index`` (0..n-1) since its previous delta.

    ``finish_reason`` is None while the sibling runs, then one of ``stop``, ``length``,
    ``abort``, ``error`` or ``repetition``; ``stop_reason`` is the matched stop string or
    token id, or ``repetition_detected``.
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``) comes with the sibling's first
    delta: one entry per prompt token after the first, in order.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class RequestOutput:
    """One batch of deltas for a request; ``finished`` once every sibling has finished."""

    request_id: str
    deltas: list[CompletionDelta] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None
    # an embedding request's answer (``SamplingParams.pooling``), with its finished output
    embedding: list[float] | None = None
    # the data-parallel replica that ran it (``EngineFront.engine_index``): the HTTP
    # metrics' ``engine`` label
    engine_index: int = 0

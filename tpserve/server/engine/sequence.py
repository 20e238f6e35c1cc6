"""One generated continuation: its tokens, progress, block table and status.

A request with ``n`` choices becomes ``n`` sibling sequences sharing ``request_id``, told
apart by ``index``. The scheduler and block manager own the mutable progress fields
(``status``, ``num_computed_tokens``, ``block_ids``); the engine appends sampled tokens
through the scheduler and decides when a sequence stops.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from types import MappingProxyType

from tpserve.model.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    FINISHED_REPETITION = "finished_repetition"  # vLLM's repetition_detection

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS


_FINISH_REASONS = MappingProxyType({
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
    SequenceStatus.FINISHED_REPETITION: "repetition",
})


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated after it so far.

    Invariants (kept by the scheduler and block manager):
    - ``seq_id`` is unique and increases with arrival; siblings of one request get
      consecutive ids with the parent (``index == 0``) first.
    - ``0 <= num_computed_tokens <= num_tokens``: the first ``num_computed_tokens`` of
      ``all_token_ids`` have their K/V in the pool, in the blocks ``block_ids`` lists in
      order (block ``i`` holds token positions ``i*block_size .. (i+1)*block_size - 1``).
    - A WAITING sequence holds no blocks and has ``num_computed_tokens == 0``.
    - ``fork_parent`` is set only while a sibling (``index > 0``) waits to share its
      parent's prompt blocks; the scheduler clears it at admission.
    - Equality is identity (``eq=False``), so sequences can key sets and dicts.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    fork_parent: Sequence | None = None
    stop_reason: str | int | None = None
    # time.monotonic() when first admitted (not reset by preemption) and when its first
    # token was read back; None until then (request queue/prefill/decode time metrics)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None  # time.monotonic() when it finished
    # the prompt's log-probabilities are all collected (``scores_prompt``); set by the engine
    prompt_scored: bool = False

    @property
    def cache_key(self) -> bytes:
        """The prefix cache's ``extra_key`` of this sequence's blocks: its request's
        ``cache_salt`` (vLLM's; hits only between requests with the same salt) and its LoRA
        adapter (an adapter's K and V are not the base model's), else none. The two are
        written as one JSON array, so no salt can spell another salt's key with an adapter
        (a salt ending in ``|lora:0`` once did)."""
        salt, lora = self.params.cache_salt, self.params.lora_id
        return b"" if salt is None and lora is None else json.dumps([salt, lora]).encode()

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence's steps must still score its prompt tokens
        (``params.prompt_logprobs``): the first sibling does, once, for the whole request,
        computing every prompt position itself (no prefix-cache hits) until it is done."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and not self.prompt_scored and self.num_prompt_tokens > 1)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether its steps must compute every prompt position themselves (no prefix-cache
        hits): while it scores its prompt, or when it is pooled over every row (MEAN, CLS)."""
        pooling = self.params.pooling
        return self.scores_prompt or (pooling is not None and pooling.pooling_type != "LAST")

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def at_length_limit(self, max_model_len: int) -> bool:
        """Whether its newest token is its last by length: ``max_tokens`` outputs, or the
        model's length (the stop rules' length finish; the scheduler decodes no further)."""
        return (self.num_output_tokens >= self.params.max_tokens
                or self.num_tokens >= max_model_len)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish reason: "stop", "length", "abort", "error", or None while live;
        vLLM's "repetition" for an output ended by ``repetition_detection``."""
        return _FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

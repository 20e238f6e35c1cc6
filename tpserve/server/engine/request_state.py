"""Engine-side state of one request: its sibling sequences, detokenizers and generators."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.detokenizer import IncrementalDetokenizer
from tpserve.server.engine.outputs import RequestOutput, TokenLogprob
from tpserve.server.engine.sequence import Sequence
from tpserve.server.engine.thinking import ThinkingCount


@dataclass(eq=False)
class RequestState:
    """Owned by the engine thread once submitted. ``emit`` hands an output (or the
    exception that ends the request) to the consumer, thread-safely. ``seqs`` (and the
    detokenizers, generators, matchers) stay empty until ``start``: a request waiting for
    its grammar compile has none (``EngineCore.add``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput | BaseException], None]
    arrival: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    # one grammar matcher per sibling (structured output), else empty; see EngineCore
    matchers: list[Any] = field(default_factory=list)
    # per sibling: its grammar still waits for ``params.structured_after`` (True: the
    # matcher has accepted nothing and masks nothing until that token is sampled), applies
    # (False), or its first token decides (None, ``params.structured_after_if_first``:
    # that token waits, any other is the grammar's; the mask allows both)
    gated: list[bool | None] = field(default_factory=list)
    # per sibling: its thinking counted against ``params.thinking`` (``thinking.py``), else
    # empty
    thinking: list[ThinkingCount] = field(default_factory=list)
    done: bool = False
    # the scored prompt (``SamplingParams.prompt_logprobs``): entry i is prompt token i + 1
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # an embedding request (``params.pooling``): the pooled float32 vector so far (MEAN:
    # the sum of its rows; CLS: the first row), on the host; reset by a chunk at position 0
    pooled: torch.Tensor | None = None

    def start(self, first_seq_id: int, tokenizer: Any, make_generator) -> None:
        """Creates the ``n`` sibling sequences; siblings wait to share the first one's
        prompt blocks. With a seed, sibling ``i`` samples from ``seed + i``."""
        n = self.params.n
        for i in range(n):
            seq = Sequence(seq_id=first_seq_id + i, request_id=self.request_id, index=i,
                           prompt_token_ids=list(self.prompt_token_ids), params=self.params,
                           arrival_time=self.arrival)
            if i > 0:
                seq.fork_parent = self.seqs[0]
            self.seqs.append(seq)
            self.detoks.append(IncrementalDetokenizer(tokenizer, self.prompt_token_ids,
                                                      self.params))
            seed = None if self.params.seed is None else self.params.seed + i
            self.generators.append(make_generator(seed))
            if self.params.thinking is not None:
                self.thinking.append(ThinkingCount(self.params.thinking))

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt tokens ``start + 1 ..`` from one step of the first sibling.
        Positions already held are skipped (a preempted sequence scores its prompt again);
        once every token after the first is held, the sibling stops scoring."""
        for i, entry in enumerate(entries):
            if start + i == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)
        if len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1:
            self.seqs[0].prompt_scored = True

    def scored_prompt(self) -> tuple[TokenLogprob, ...] | None:
        """The whole scored prompt for a sibling's first delta (None when not asked for)."""
        if self.params.prompt_logprobs is None:
            return None
        if len(self.prompt_logprobs) != len(self.prompt_token_ids) - 1:
            raise RuntimeError(f"request {self.request_id}: a first output before its "
                               f"prompt was scored ({len(self.prompt_logprobs)} of "
                               f"{len(self.prompt_token_ids) - 1} tokens)")
        return tuple(self.prompt_logprobs)

    @property
    def all_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def observe_times(self, histograms: dict[str, Any]) -> None:
        """Observes a finished request's queue (arrival -> first scheduled), prefill (-> first
        token) and decode (-> its finish) times into the engine's
        ``request_*_time_seconds`` histograms, once for each of its sequences that produced
        a token (as vLLM, whose engine runs each of ``n`` sequences as a request)."""
        now = time.monotonic()
        for s in self.seqs:
            if s.first_scheduled_time is None or s.first_token_time is None:
                continue
            histograms["request_queue_time_seconds"].observe(
                max(0.0, s.first_scheduled_time - self.arrival))
            histograms["request_prefill_time_seconds"].observe(
                max(0.0, s.first_token_time - s.first_scheduled_time))
            histograms["request_decode_time_seconds"].observe(
                max(0.0, (s.finish_time or now) - s.first_token_time))

    def usage(self) -> dict[str, int]:
        return {"num_prompt_tokens": len(self.prompt_token_ids),
                "num_output_tokens": sum(s.num_output_tokens for s in self.seqs),
                "num_cached_tokens": self.seqs[0].num_cached_tokens if self.seqs else 0}

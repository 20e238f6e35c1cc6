"""Beam search (vLLM's ``use_beam_search``), run by the HTTP layer as vLLM runs it.

A request of beam width ``W`` (its ``n``) keeps ``W`` live beams, starting from the prompt
alone. Each step asks the engine, for every live beam, for one token of the beam's tokens
with the ``2W`` most likely next tokens and their log-probabilities (a one-token request,
``beam_step_params``; the prefix cache keeps the beam's earlier blocks, so a step computes
little more than its new token). A candidate is a beam and one of those tokens, scored by
the beam's summed log-probability plus the token's. Candidates ending the beam (EOS unless
``ignore_eos``, or a ``stop_token_ids`` entry, from ``min_tokens`` on) go to the finished
beams; the ``W`` best of the others become the live beams. After ``max_tokens`` steps the
live beams finish by length, and the ``W`` finished beams of the highest
``sum_logprob / length ** length_penalty`` are the answer's choices, best first, where
``length`` counts the prompt and the output without an ending token (vLLM's score). Ties
go to the earlier beam, then to the more likely token, so answers are deterministic. A
search that finds fewer than ``W`` beams (``allowed_token_ids`` with fewer tokens) answers
those alone, as vLLM's. A beam's text is the engine's: its ending stop token or EOS adds
none unless ``include_stop_str_in_output`` (its id and logprob stay).

The log-probabilities, which rank the beams and are the ones an answer reports, are the
sampler's processed ones whatever ``--logprobs-mode`` says: after ``repetition_penalty``,
``logit_bias``, ``allowed_token_ids`` and ``min_tokens``' masking (which the one-token
requests carry, each over the beam's tokens as its prompt); a beam step is greedy, so no
temperature or filter applies. (vLLM's beam search takes none of those fields, and reads
the engine's mode.) What beam search cannot honour is refused (``check_beam_search``).
The answer comes whole, also when streamed: one chunk at the end, as vLLM's.

Each step's requests are closed however the step ends (an error, a client gone), so the
engine aborts them and their blocks go back to the pool. A search runs as one job of its
engine (``EngineClient.job``): a drain (SIGTERM) waits for it as for a request, its steps
let in until the shutdown timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.detokenizer import IncrementalDetokenizer
from tpserve.server.engine.errors import EngineError
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from tpserve.server.http.engine_client import EngineClient
from tpserve.server.http.http_errors import APIError
from tpserve.server.http.protocol import SamplingRequest
from tpserve.server.http.structured import constraint_fields

NEUTRAL = {"temperature": (0.0, 1.0), "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,)}


def check_beam_search(body: SamplingRequest, params: SamplingParams, max_logprobs: int
                      ) -> None:
    """400 for what beam search cannot honour: stop strings, output-count penalties,
    bad words, structured output, prompt logprobs, a thinking budget, repetition detection,
    chosen logprob tokens, best_of; sampling
    knobs other than their neutral values (log-probabilities are taken before them); a
    width ``n`` whose ``2n`` candidates a beam would pass ``max_logprobs``.
    ``length_penalty`` without ``use_beam_search`` is refused too (it would change
    nothing)."""
    if not body.use_beam_search:
        if body.length_penalty not in (None, 1.0):
            raise APIError.bad_request("length_penalty applies to beam search only "
                                       "(use_beam_search: true)", "length_penalty")
        return

    def refuse(field: str, why: str) -> None:
        raise APIError.bad_request(f"{field} is not supported with beam search: {why}", field)

    for name, neutral in NEUTRAL.items():
        if getattr(body, name) is not None and getattr(body, name) not in neutral:
            refuse(name, "candidates are ranked by the model's log-probabilities, which "
                   "are taken before the sampling knobs")
    if params.stop:
        refuse("stop", "use stop_token_ids")
    if params.presence_penalty or params.frequency_penalty:
        refuse("presence_penalty" if params.presence_penalty else "frequency_penalty",
               "a beam's tokens are the prompt of its next step; repetition_penalty works")
    if params.bad_words_token_ids:
        refuse("bad_words", "use logit_bias or allowed_token_ids")
    if params.structured is not None:  # the body's constraint, else its tool_choice's
        found = constraint_fields(body)
        refuse(found[0][0] if found else "tool_choice",
               "structured output needs one grammar state a beam")
    if body.prompt_logprobs is not None:
        refuse("prompt_logprobs", "ask for them without use_beam_search")
    if params.prompt_logprobs is not None:  # a completion's echo with logprobs
        refuse("echo", "with logprobs it scores the prompt; ask for them without "
               "use_beam_search, or without logprobs")
    if params.thinking is not None:
        refuse("thinking_token_budget", "a budget is counted per sequence, not per beam")
    if params.repetition is not None:
        refuse("repetition_detection", "a beam ends by its stop tokens or its length")
    if params.logprob_token_ids is not None:
        refuse("logprob_token_ids", "a beam's logprobs are its top candidates")
    if params.n < 1 or 2 * params.n > max_logprobs:
        raise APIError.bad_request(
            f"beam search's width n is from 1 to {max_logprobs // 2} on this server "
            f"(2n candidates a beam, at most --max-logprobs {max_logprobs})", "n")


@dataclass(frozen=True)
class Beam:
    """One hypothesis: its output tokens so far, their summed log-probability, the
    per-token logprobs the request asked for, and how it finished (None: live)."""

    tokens: tuple[int, ...]
    cum_logprob: float
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | None = None

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's: the summed log-probability over the length (prompt and output, without
        an ending token) to the power ``length_penalty``."""
        length = prompt_len + len(self.tokens) - (self.finish_reason == "stop")
        return self.cum_logprob / (length ** length_penalty)


def beam_step_params(params: SamplingParams, step: int) -> SamplingParams:
    """The one-token request of step ``step`` (0-based) of every live beam: greedy, with
    the ``2n`` most likely tokens (or the request's own ``logprobs``, if more) by their
    processed log-probabilities (after the repetition penalty, the logit bias and the
    allowed ids, whatever ``--logprobs-mode`` says), and ``min_tokens``' masking while the
    beams are shorter than ``min_tokens``."""
    return replace(params, n=1, max_tokens=1, temperature=0.0, top_p=1.0, top_k=0,
                   min_p=0.0, seed=None, min_tokens=1 if step < params.min_tokens else 0,
                   logprobs=max(2 * params.n, params.logprobs or 0), prompt_logprobs=None,
                   logprobs_mode="processed_logprobs")


class BeamSet:
    """The search's state (no I/O): the live beams, the finished ones, and the rule that
    advances them by one step (module doc). ``ends`` are the token ids that end a beam,
    ``stop_token_ids`` those among them reported as the stop reason, ``asked`` the
    request's ``logprobs`` (None: none kept)."""

    def __init__(self, width: int, prompt_len: int, ends: frozenset[int],
                 stop_token_ids: frozenset[int] = frozenset(), length_penalty: float = 1.0,
                 asked: int | None = None):
        self.width, self.prompt_len, self.ends = width, prompt_len, ends
        self.stop_token_ids, self.length_penalty, self.asked = (stop_token_ids,
                                                                length_penalty, asked)
        self.live: list[Beam] = [Beam((), 0.0)]
        self.finished: list[Beam] = []

    def advance(self, tops: list[tuple[tuple[int, str, float], ...]]) -> None:
        """One step: ``tops[b]`` is live beam ``b``'s next tokens ``(id, text, logprob)``,
        most likely first; its first ``2 x width`` are its candidates."""
        candidates = []  # (minus the summed logprob, beam, rank, entry): best first sorted
        for b, (beam, top) in enumerate(zip(self.live, tops, strict=True)):
            for rank, entry in enumerate(top[:2 * self.width]):
                if entry[2] != float("-inf"):  # masked (allowed_token_ids, min_tokens)
                    candidates.append((-(beam.cum_logprob + entry[2]), b, rank, entry))
        candidates.sort(key=lambda c: c[:3])
        survivors: list[Beam] = []
        for _, b, _, entry in candidates:
            token = entry[0]
            if token not in self.ends and len(survivors) == self.width:
                continue
            beam = self.live[b]
            grown = Beam(beam.tokens + (token,), beam.cum_logprob + entry[2],
                         beam.logprobs + _logprob(entry, tops[b], self.asked))
            if token in self.ends:
                self.finished.append(replace(grown, finish_reason="stop", stop_reason=(
                    token if token in self.stop_token_ids else None)))
            else:
                survivors.append(grown)
        self.live = survivors

    def best(self) -> list[Beam]:
        """The answer: the live beams finished by length beside the finished ones, the
        ``width`` of the highest score, best first (ties: the earlier finished)."""
        done = self.finished + [replace(beam, finish_reason="length") for beam in self.live]
        order = sorted(range(len(done)), key=lambda i: (
            -done[i].score(self.prompt_len, self.length_penalty), i))
        return [done[i] for i in order[:self.width]]


async def beam_search(engine: EngineClient, request_id: str, prompt_ids: list[int],
                      params: SamplingParams, length_penalty: float | None
                      ) -> AsyncIterator[RequestOutput]:
    """One prompt's beam search (module doc); yields its one finished output, a delta of
    index ``i`` for the ``i``-th best beam. Every step goes to one engine
    (``EngineClient.pinned``: one data-parallel replica), whose prefix cache holds the
    beams' blocks."""
    engine = engine.pinned(prompt_ids, params)
    stops = frozenset(params.stop_token_ids)
    beams = BeamSet(params.n, len(prompt_ids),
                    stops | (frozenset() if params.ignore_eos else engine.eos_token_ids),
                    stops, 1.0 if length_penalty is None else length_penalty,
                    params.logprobs)
    with engine.job():  # a drain lets the search finish (EngineClient.job)
        for step in range(params.max_tokens):
            sub = beam_step_params(params, step)
            beams.advance(list(await asyncio.gather(*(
                _top_tokens(engine, f"{request_id}-s{step}-b{b}",
                            prompt_ids + list(beam.tokens), sub)
                for b, beam in enumerate(beams.live)))))
            if not beams.live:
                break
    best = beams.best()
    yield RequestOutput(
        request_id, [_delta(i, beam, engine, prompt_ids, params) for i, beam in enumerate(best)],
        num_prompt_tokens=len(prompt_ids),
        num_output_tokens=sum(len(beam.tokens) for beam in best), finished=True,
        engine_index=getattr(engine, "engine_index", 0))  # the replica of every step


async def _top_tokens(engine: EngineClient, request_id: str, ids: list[int],
                      params: SamplingParams) -> tuple[tuple[int, str, float], ...]:
    """One beam's step: the next tokens' ``(id, text, logprob)``, most likely first."""
    outputs = engine.generate(request_id, ids, params, in_job=True)
    top = None
    try:
        async for out in outputs:
            if out.error:
                raise EngineError(out.error)
            for delta in out.deltas:
                if delta.logprobs:
                    top = delta.logprobs[0].top
            if out.finished:
                break
    finally:
        await outputs.aclose()
    if top is None:
        raise EngineError(f"beam step {request_id} ended without a token")
    return top


def _logprob(entry: tuple[int, str, float], top: tuple[tuple[int, str, float], ...],
             asked: int | None) -> tuple[TokenLogprob, ...]:
    """The chosen token's entry for the answer's logprobs (none unless asked)."""
    if asked is None:
        return ()
    return (TokenLogprob(entry[0], entry[1], entry[2], top[:asked]),)


def _delta(index: int, beam: Beam, engine: EngineClient, prompt_ids: list[int],
           params: SamplingParams) -> CompletionDelta:
    """A finished beam as one choice, its text detokenized as the engine would
    (``engine/stop_rules.py``): the stop token id or EOS that ended it adds no text unless
    ``include_stop_str_in_output``, and stays in its token ids and logprobs."""
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids, params)
    shown = beam.tokens
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        shown = shown[:-1]
    text = "".join(detok.add_token(t) for t in shown) + detok.flush()
    return CompletionDelta(index, text, beam.tokens,
                           beam.logprobs if params.logprobs is not None else None,
                           beam.finish_reason, beam.stop_reason)

"""A launched step whose results are not read back yet (``InFlight``), and reading back
its side outputs when the step is finalized: scored prompt rows (``collect_prompt``) and
pooled sums (``collect_pooled``). Every wait for the device is added to the engine's
``device_wait_seconds_total``. Runs on the engine thread only (see ``engine_core``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.model.pooling import finish_classification, finish_embedding
from tpserve.model.prompt_logprobs import PromptLogprobs
from tpserve.model.sampler import PendingSample
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.sequence import Sequence
from tpserve.server.engine.token_texts import TokenTexts


@dataclass
class InFlight:
    """A launched step whose results (sampled tokens, scored prompt rows, pooled sums) are
    not read back yet; at most one exists at a time (``EngineCore._inflight``)."""

    sampling: list[Sequence]     # the sequences the step samples, in row order
    sample: PendingSample        # host copies, valid once ``event`` completed
    event: Any                   # torch.cuda.Event, or None on CPU
    # seq_id -> its first row: every sampled sequence's when launched, then only those
    # given a placeholder (the ones ``_finalize`` reads)
    rows: dict[int, int]
    # speculative decoding: seq_id -> draft, whose rows follow their sequence's first
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # prompt scoring: (sequence, first position, rows) per scored chunk, in plan order, and
    # the runner's result for those rows (still on the device)
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)
    prompt: PromptLogprobs | None = None  # host copies, valid once ``prompt_event`` completed
    prompt_event: Any = None
    # pooling: (sequence, first position, final, output row or -1) per pooled chunk, and
    # the pooled sums of the step (host copy, valid once ``pooled_event`` completed)
    pooling: list[tuple[Sequence, int, bool, int]] = field(default_factory=list)
    pooled: torch.Tensor | None = None
    pooled_event: Any = None


def host_copy_event(like: torch.Tensor) -> Any:
    """An event recorded after the copies to the host just queued (on CUDA; else None:
    a CPU copy is done when it returns)."""
    if like.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for(event: Any, counters: dict[str, float]) -> None:
    """Waits for ``event`` (None: nothing to wait for), the time counted as the device's."""
    if event is not None:
        t = time.perf_counter()
        event.synchronize()
        counters["device_wait_seconds_total"] += time.perf_counter() - t


def collect_prompt(flight: InFlight, requests: dict[str, RequestState],
                   counters: dict[str, float], texts: TokenTexts) -> None:
    """Hands each scored chunk's rows (read back now) to its request. Each text is read at
    its prompt position, after the prompt's tokens before it (``TokenTexts``)."""
    assert flight.prompt is not None
    wait_for(flight.prompt_event, counters)
    host = flight.prompt
    lps, ranks, top_ids, top_lps = (host.logprobs.tolist(), host.ranks.tolist(),
                                    host.top_ids.tolist(), host.top_logprobs.tolist())
    row = 0
    for seq, start, k in flight.scored:
        state = requests.get(seq.request_id)
        if state is not None and not seq.is_finished:
            want = seq.params.prompt_logprobs
            entries = []
            prompt = seq.prompt_token_ids
            for r in range(row, row + k):
                at = start + 1 + r - row
                pairs = zip(top_ids[r][:want], top_lps[r][:want], strict=True)
                top = tuple((t, texts(t, prompt, at), lp) for t, lp in pairs)
                entries.append(TokenLogprob(prompt[at], texts(prompt[at], prompt, at),
                                            lps[r], top, ranks[r]))
            state.add_prompt_logprobs(start, entries)
        row += k


def collect_pooled(flight: InFlight, requests: dict[str, RequestState],
                   counters: dict[str, float], histograms: dict[str, Any],
                   classifier: torch.Tensor | None = None) -> None:
    """Adds each pooled chunk's sum (read back now) to its request's vector, and
    answers each request whose last chunk this was with its embedding (a classifier's
    server, ``classifier`` its head: with its label probabilities)."""
    wait_for(flight.pooled_event, counters)
    for seq, start, final, out in flight.pooling:
        state = requests.get(seq.request_id)
        if state is None:  # aborted meanwhile (abort takes the request out first)
            continue
        if out >= 0:
            assert flight.pooled is not None
            part = flight.pooled[out]
            # a chunk at position 0 starts the vector over (after a preemption too)
            state.pooled = part.clone() if start == 0 or state.pooled is None \
                else state.pooled + part
        if not final:
            continue
        pooling = seq.params.pooling
        seq.first_token_time = time.monotonic()
        assert state.pooled is not None, "a pooled sequence ended with no pooled rows"
        if classifier is not None:
            embedding = finish_classification(state.pooled, seq.num_prompt_tokens,
                                              pooling.pooling_type, classifier)
        else:
            embedding = finish_embedding(state.pooled, seq.num_prompt_tokens,
                                         pooling.pooling_type, pooling.normalize,
                                         pooling.dimensions)
        state.done = True
        del requests[seq.request_id]
        state.emit(RequestOutput(seq.request_id, [CompletionDelta(0, "", (), None, "stop")],
                                 finished=True, embedding=embedding, **state.usage()))
        state.observe_times(histograms)

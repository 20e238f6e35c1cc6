"""What a sequence's newest output token ends: the stop rules, applied after detokenizing it."""

from __future__ import annotations

import logging
from typing import Any

from tpserve.server.engine.grammar_gate import after_token
from tpserve.server.engine.outputs import TokenLogprob
from tpserve.server.engine.repetition import REPETITION_DETECTED, repeats
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.sequence import Sequence, SequenceStatus
from tpserve.server.engine.token_texts import TokenTexts

logger = logging.getLogger(__name__)


def apply_stop_rules(seq: Sequence, state: RequestState, eos_token_ids: frozenset[int],
                     max_model_len: int) -> tuple[str, SequenceStatus | None, Any]:
    """Detokenizes ``seq``'s newest output token, advances its grammar matcher and its
    thinking count, and returns ``(text, status, reason)``: the text the token completes,
    and the status it ends the sequence with (None: it goes on) and its stop reason (a
    stop string or token id, or ``REPETITION_DETECTED``).

    A gated grammar (``SamplingParams.structured_after``, ``grammar_gate.py``) accepts
    nothing up to and including its gate token. The first rule that holds wins: a token the grammar refuses
    (an error: the mask allowed it), a stop string, a stop token id (from ``min_tokens``
    on), EOS (from ``min_tokens`` on, unless ``ignore_eos``), the grammar's end,
    ``max_tokens`` or the model's length, a repeating tail (``repetition_detection``, from
    ``min_tokens`` on).
    A stop token id or EOS that ends the sequence adds no text unless
    ``include_stop_str_in_output`` (as vLLM: the token id stays in the output). A sequence
    that ends other than by a stop string gets the detokenizer's held-back text too.
    Nothing here changes the scheduler: the caller finishes the sequence."""
    detok = state.detoks[seq.index]
    token = seq.output_token_ids[-1]
    params = seq.params
    n_out = seq.num_output_tokens
    stop_token = n_out >= params.min_tokens and (
        token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids))
    text = "" if stop_token and not params.include_stop_str_in_output \
        else detok.add_token(token)
    status, reason = None, None
    matcher = state.matchers[seq.index] if state.matchers else None
    grammar_ended = False
    if state.thinking:
        state.thinking[seq.index].accept(token)
    if matcher is not None:
        state.gated[seq.index], takes = after_token(state.gated[seq.index], token, params)
        if takes and not matcher.accept_token(token):  # the mask allowed it: a bug
            logger.error("request %s: grammar refused sampled token %d", seq.request_id, token)
            status = SequenceStatus.FINISHED_ERROR
        grammar_ended = takes and matcher.is_terminated()
    if status is not None:
        pass
    elif detok.stopped:
        status, reason = SequenceStatus.FINISHED_STOPPED, detok.stop_reason
    elif n_out >= params.min_tokens and token in params.stop_token_ids:
        status, reason = SequenceStatus.FINISHED_STOPPED, token
    elif n_out >= params.min_tokens and not params.ignore_eos and token in eos_token_ids:
        status = SequenceStatus.FINISHED_STOPPED
    elif grammar_ended:
        status = SequenceStatus.FINISHED_STOPPED
    elif seq.at_length_limit(max_model_len):
        status = SequenceStatus.FINISHED_LENGTH
    elif (params.repetition is not None and n_out >= params.min_tokens
          and repeats(seq.output_token_ids, params.repetition)):
        status, reason = SequenceStatus.FINISHED_REPETITION, REPETITION_DETECTED
    if status is not None and not detok.stopped:
        text += detok.flush()
    return text, status, reason


def token_logprobs(seq: Sequence, row: int, result: Any,
                   texts: TokenTexts) -> tuple[TokenLogprob, ...] | None:
    """The newest token's log-probability and its top alternatives (row ``row`` of the
    step's sample ``result``), when the request asked for log-probabilities. Each text is
    read at the token's position after the sequence's earlier output tokens (``TokenTexts``:
    a token holding part of a character gets its share of it)."""
    if seq.params.logprobs is None or result is None:
        return None
    out = seq.output_token_ids
    end = len(out) - 1
    token = out[end]
    top = tuple((t, texts(t, out, end), lp) for t, lp in result.top_logprobs[row])
    return (TokenLogprob(token, texts(token, out, end), result.logprobs[row], top),)

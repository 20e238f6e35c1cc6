"""Steps 1-2 of the sampling pipeline (``sampler``): in-place edits of float32 logits
``[rows, vocab]``, one row per sequence, before logprobs and sampling.

``process_`` applies them in the pipeline's order: penalties, min_tokens, bad words,
logit_bias, allowed_token_ids, then the grammar bitmask. Each step leaves rows that do not
ask for it untouched, and ids outside the vocabulary are ignored (the HTTP layer refuses
them). Row and column indices go up to the device without waiting (``host_copy``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tpserve.model.host_copy import to_device
from tpserve.model.sampling_params import SamplingParams
from tpserve.model.token_bitmask import TokenBitmask, apply_token_bitmask_


def process_(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: frozenset[int],
    bitmask: TokenBitmask | None,
) -> None:
    """In place, in order: penalties, min_tokens, bad words, logit_bias,
    allowed_token_ids and the grammar ``bitmask`` (constrained rows only)."""
    penalize_(logits, params, prompt_token_ids, output_token_ids)
    mask_min_tokens_(logits, params, output_token_ids, eos_token_ids)
    ban_bad_words_(logits, params, output_token_ids)
    bias_(logits, params)
    allow_only_(logits, params)
    if bitmask is not None:
        apply_token_bitmask_(logits, bitmask)


def forbid_(logits: torch.Tensor, row_idx: list[int], col_idx: list[int]) -> None:
    """In place: -inf at the ``(row, col)`` pairs given, if any."""
    if row_idx:
        rows = to_device(row_idx, torch.long, logits.device)
        cols = to_device(col_idx, torch.long, logits.device)
        logits[rows, cols] = -math.inf


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``[len(token_ids), vocab_size]`` float32 occurrence counts (ids out of range ignored)."""
    rows = len(token_ids)
    longest = max((len(t) for t in token_ids), default=0)
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=device)
    if longest:
        padded = [list(t) + [vocab_size] * (longest - len(t)) for t in token_ids]
        index = to_device(padded, torch.long, device).clamp_(0, vocab_size)
        counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]


def bias_(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: adds each row's ``logit_bias`` (ids outside the vocabulary are ignored;
    the HTTP layer refuses them)."""
    vocab = logits.shape[-1]
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            if 0 <= token < vocab:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((to_device(rows, torch.long, device), to_device(cols, torch.long, device)),
                          to_device(values, torch.float32, device), accumulate=True)


def allow_only_(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: every logit outside a row's ``allowed_token_ids`` becomes -inf (ids
    outside the vocabulary are ignored; the HTTP layer refuses them)."""
    vocab = logits.shape[-1]
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return
    device = logits.device
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for r, i in enumerate(rows):
        ids = [t for t in params[i].allowed_token_ids if t < vocab]
        keep[r, to_device(ids, torch.long, device)] = True
    index = to_device(rows, torch.long, device)
    logits[index] = logits[index].masked_fill(~keep, -math.inf)


def penalize_(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """In-place penalties on float32 ``logits``; rows without penalties are left untouched."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    index = to_device(rows, torch.long, device)
    sub = logits.index_select(0, index)

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device).unsqueeze(1)

    if any(params[i].repetition_penalty != 1.0 for i in rows):
        seen = token_counts(
            [list(prompt_token_ids[i]) + list(output_token_ids[i]) for i in rows], vocab, device
        ) > 0
        rep = column([params[i].repetition_penalty for i in rows])
        sub = torch.where(seen, torch.where(sub < 0, sub * rep, sub / rep), sub)
    if any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in rows):
        counts = token_counts([output_token_ids[i] for i in rows], vocab, device)
        freq = column([params[i].frequency_penalty for i in rows])
        pres = column([params[i].presence_penalty for i in rows])
        sub = sub - (freq * counts + pres * (counts > 0).to(torch.float32))
    logits.index_copy_(0, index, sub)


def mask_min_tokens_(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: frozenset[int],
) -> None:
    """In place: -inf on EOS and stop token ids of rows still short of ``min_tokens``."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            for t in sorted(set(eos_token_ids) | set(p.stop_token_ids)):
                if 0 <= t < vocab:
                    row_idx.append(i)
                    col_idx.append(t)
    forbid_(logits, row_idx, col_idx)


def ban_bad_words_(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """In place: -inf on the last token of every bad-word sequence that the output's
    tokens would complete (one-token words always)."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, p in enumerate(params):
        out = output_token_ids[i]
        for word in p.bad_words_token_ids:
            head = len(word) - 1
            if word[-1] < vocab and (head == 0 or (
                    len(out) >= head and list(out[len(out) - head:]) == list(word[:-1]))):
                row_idx.append(i)
                col_idx.append(word[-1])
    forbid_(logits, row_idx, col_idx)

"""Prompt log-probabilities: how likely the model finds each prompt token given the ones
before it (the completions API's ``echo`` with ``logprobs``; what lm-eval's loglikelihood
and perplexity tasks read).

A step that carries them (``StepPlan.prompt_rows``) runs eagerly: its hidden states at
those rows go through the LM head in slices of ``score_slice_rows`` rows, on every rank,
since the head's all-gather is a collective. A slice's temporaries (the logits, their
float32 copy and log-softmax, the rank comparison) fit in the profiled activation
workspace, which the forward has released by then; slices of the sampler's row bound
alone ran ~4,000 small launches per 256k scored tokens (H200, ``bench_scoring.py``). Rank 0 keeps, per
row, the float32 ``log_softmax`` of the raw logits at the target token (no penalty, bias
or temperature: the model's own distribution, as vLLM reports prompt logprobs), the
target's rank (1 = the most likely token) and the ``top`` most likely tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.model.host_copy import to_host_async


@dataclass(frozen=True)
class PromptLogprobs:
    """Per scored row, on the device until ``to_host``: ``logprobs`` float32 [R], ``ranks``
    int64 [R], ``top_ids`` int64 [R, K] and ``top_logprobs`` float32 [R, K] (descending)."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def to_host(self) -> PromptLogprobs:
        """Copies on their way to pinned host memory (``host_copy.to_host_async``: the
        caller waits on an event recorded after them before reading)."""
        return PromptLogprobs(*(to_host_async(t) for t in (
            self.logprobs, self.ranks, self.top_ids, self.top_logprobs)))


SCORE_BYTES_PER_LOGIT = 14  # bf16 logits, float32 copy and log-softmax, a bool comparison


def score_slice_rows(sampler_rows: int, workspace_bytes: int, vocab_size: int) -> int:
    """Rows per LM-head slice: as many as the activation workspace holds the temporaries
    of, at least the sampler's row bound."""
    return max(sampler_rows, workspace_bytes // (SCORE_BYTES_PER_LOGIT * vocab_size))


def _top(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``lp.topk(k, dim=1)``; k = 1 through ``max`` (on the H200 ``topk(1)`` over 128k
    columns took ~2.6 ms more per 421-row slice than ``topk(20)``, ``bench_scoring.py``
    call h), k = 0 empty."""
    if k == 0:
        return lp[:, :0], torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
    if k == 1:
        values, ids = lp.max(dim=1, keepdim=True)
        return values, ids
    return lp.topk(k, dim=1)


def score_prompt_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                      hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                      slice_rows: int, top: int, keep: bool) -> PromptLogprobs | None:
    """``hidden[rows]`` scored against ``targets`` (see the module docstring); every rank
    calls this with the same plan, and only the one with ``keep`` gets a result."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in range(0, rows.shape[0], slice_rows):
        logits = compute_logits(hidden[rows[i:i + slice_rows]])
        if not keep:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        target = lp.gather(1, targets[i:i + slice_rows, None])
        ranks = (lp > target).sum(dim=1) + 1
        top_lp, top_ids = _top(lp, min(top, lp.shape[1]))
        parts.append((target[:, 0], ranks, top_ids, top_lp))
    if not keep:
        return None
    return PromptLogprobs(*(torch.cat(p) for p in zip(*parts, strict=True)))

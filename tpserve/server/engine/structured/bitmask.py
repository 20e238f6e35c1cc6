"""The packed token bitmask of one step's constrained rows, filled on the host."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from tpserve.model.token_bitmask import TokenBitmask


def fill_bitmask(rows: Sequence[tuple[int, xgr.GrammarMatcher]], vocab_size: int,
                 device: torch.device, grammar_rows: int | None = None
                 ) -> TokenBitmask | None:
    """One bitmask for ``rows`` (logits row, that row's matcher in its current state), on
    ``device``: filled in (pinned, on CUDA) host memory and sent up without waiting, so
    the copy queues behind the step already running on the device. None without rows.
    ``grammar_rows``: the first that many are grammars' (``TokenBitmask.grammar_rows``)."""
    if not rows:
        return None
    width = (vocab_size + 31) // 32
    bits = torch.empty((len(rows), width), dtype=torch.int32,
                       pin_memory=device.type == "cuda")
    for j, (_, matcher) in enumerate(rows):
        matcher.fill_next_token_bitmask(bits, j)
    index = torch.tensor([row for row, _ in rows], dtype=torch.int64,
                         pin_memory=device.type == "cuda")
    if device.type != "cuda":
        return TokenBitmask(bits.to(device), index.to(device), grammar_rows)
    return TokenBitmask(bits.to(device, non_blocking=True), index.to(device, non_blocking=True),
                        grammar_rows)

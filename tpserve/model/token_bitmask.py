"""Grammar masks on the logits: one packed bitmask for the constrained rows of a step.

The mask is built on the host (by the engine's grammar matchers) and applied here on the
logits' device, after penalties, min_tokens and logit_bias and before logprobs and
sampling, so a constrained row can only sample a token its grammar allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class TokenBitmask:
    """Token ``t`` is allowed in logits row ``rows[j]`` iff bit ``t % 32`` of
    ``bits[j, t // 32]`` is set (xgrammar's layout; ``bits`` is int32
    ``[R, ceil(V / 32)]``). Both tensors live on the logits' device; rows not listed are
    left untouched."""

    bits: torch.Tensor  # int32 [R, W]
    rows: torch.Tensor  # int64 [R]
    # the first this many rows are grammars' (None: all); the others force one token (a
    # thinking budget's end), which raw logprobs do not see, as in vLLM
    grammar_rows: int | None = None

    def grammar_part(self) -> TokenBitmask | None:
        """The grammars' rows alone (None: there are none)."""
        n = self.rows.shape[0] if self.grammar_rows is None else self.grammar_rows
        if n == self.rows.shape[0]:
            return self
        return TokenBitmask(self.bits[:n], self.rows[:n]) if n else None


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 packed bits -> ``[R, vocab_size]`` bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1  # arithmetic shift, then the low bit
    return unpacked.view(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """In place: -inf on ``logits`` ``[M, V]`` wherever ``mask`` forbids a token."""
    vocab = logits.shape[-1]
    if mask.bits.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask of {mask.bits.shape[1]} words cannot cover {vocab} tokens")
    allowed = unpack_bitmask(mask.bits, vocab)
    sub = logits.index_select(0, mask.rows).masked_fill_(~allowed, -math.inf)
    logits.index_copy_(0, mask.rows, sub)

"""Where one sequence's grammar starts: at the first output token, or after its gate token
(``SamplingParams.structured_after``: the end of a reasoning model's thinking).

A sequence's gate (``RequestState.gated``) is one of:
- ``False``: the grammar applies; its matcher accepts every output token from here on;
- ``True``: it waits; the tokens up to and including ``structured_after`` are free (the
  matcher accepts none of them and masks nothing);
- ``None``: the first output token decides (``structured_after_if_first``: a model whose
  outputs think only when they begin with its start tag). That token may be the start
  tag or any token the grammar allows (``WithToken``); the start tag makes the grammar
  wait, any other token is the grammar's own first one.
"""

from __future__ import annotations

from typing import Any

import torch

from tpserve.model.sampling_params import SamplingParams


def first_gate(params: SamplingParams) -> bool | None:
    """A constrained sequence's gate before its first output token."""
    if params.structured_after_if_first is not None:
        return None
    return params.structured_after is not None


def after_token(gate: bool | None, token: int, params: SamplingParams
                ) -> tuple[bool | None, bool]:
    """(the gate after ``token``, the sequence's next output token, and whether the
    grammar's matcher accepts ``token``)."""
    if gate is None:
        gate = token == params.structured_after_if_first
        return gate, not gate
    if gate:
        return token != params.structured_after, False  # the grammar starts next
    return False, True


class WithToken:
    """A bitmask filler (xgrammar's ``fill_next_token_bitmask``): what ``matcher`` allows,
    and ``token`` too."""

    def __init__(self, matcher: Any, token: int):
        self.matcher = matcher
        self.token = token

    def fill_next_token_bitmask(self, bits: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bits, index)
        word, bit = divmod(self.token, 32)
        value = (int(bits[index, word]) & 0xFFFFFFFF) | (1 << bit)
        bits[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32

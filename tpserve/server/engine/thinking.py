"""One sequence's thinking counted against its budget (``SamplingParams.thinking``), and
the one-token mask that ends it.

The count follows the tokens read back, in order (``accept``, from the stop rules), as
the reasoning split of the HTTP layer reads their text (``http/reasoning/split.py``):
- ``START``: no output yet. An output that begins with the start tag is thinking (the
  tag is not counted); any other first token is thinking when the budget ``opens``, else
  the answer;
- ``THINKING``: every token counts, up to the end tag, which ends it (``DONE``);
- ``DONE``: the answer; nothing more is counted or forced.

With asynchronous scheduling the newest token may not be read back when the next step
samples (``pending``). ``may_end(pending)`` says whether the step might have to force the
end tag: then the engine reads that token back before the step samples, and
``must_end()``, now exact, decides.
"""

from __future__ import annotations

from typing import Any

import torch

from tpserve.model.sampling_params import ThinkingBudget

START, THINKING, DONE = "start", "thinking", "done"


class ThinkingCount:
    """The thinking tokens one sequence has written so far, against ``budget``."""

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.phase = START
        self.count = 0  # thinking tokens read back (tags excluded)

    @property
    def done(self) -> bool:
        return self.phase == DONE

    def accept(self, token: int) -> None:
        """The sequence's next output token, read back."""
        b = self.budget
        if self.phase == START:
            if token == b.start_id:
                self.phase = THINKING
                return
            self.phase = THINKING if b.opens else DONE
        if self.phase == THINKING:
            if token == b.end_id:
                self.phase = DONE
            else:
                self.count += 1

    def must_end(self) -> bool:
        """Whether the next token must be the end tag (every token read back)."""
        thinking = self.phase == THINKING or (self.phase == START and self.budget.opens)
        return thinking and self.count >= self.budget.tokens

    def may_end(self, pending: int) -> bool:
        """Whether the next token might have to be the end tag, ``pending`` tokens (0 or 1)
        not read back yet (0: exactly ``must_end``)."""
        if not pending:
            return self.must_end()
        return self.phase != DONE and self.count + pending >= self.budget.tokens


def may_end_thinking(sampling: list[Any], requests: dict[str, Any], placeholder: int) -> bool:
    """Whether a row of a step sampling ``sampling`` (``Sequence``s; ``requests``: their
    ``RequestState``s by id) might have to end its thinking now, its newest token maybe
    still ``placeholder`` (in flight)."""
    for seq in sampling:
        if seq.params.thinking is None:
            continue
        state = requests.get(seq.request_id)
        if state is not None and state.thinking and not seq.is_finished:
            out = seq.output_token_ids
            if state.thinking[seq.index].may_end(int(bool(out) and out[-1] == placeholder)):
                return True
    return False


class ForcedToken:
    """A bitmask filler (xgrammar's ``fill_next_token_bitmask``) allowing one token."""

    def __init__(self, token: int):
        self.token = token

    def fill_next_token_bitmask(self, bits: torch.Tensor, index: int) -> None:
        word, bit = divmod(self.token, 32)
        bits[index].zero_()
        bits[index, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's sign bit

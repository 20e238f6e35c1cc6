"""Speculative decoding's state in the engine: whether a step drafts, and what drafts kept.

``Drafting`` is the one object the engine asks about speculation (``speculative.py`` holds
the method: the drafts, the rows they sample, the tokens kept). A step may draft while the
backoff is not pausing it (``draft_backoff.py``) and at most ``disable_by_batch_size``
sequences run. ``record`` counts one verified draft as it is finalized; ``end_step``
closes a launched step, after its finalize (a drafted step runs synchronously), and hands
the backoff what the step kept.

The counters are vLLM's (``spec_decode_num_drafts_total``, ``..._draft_tokens_total``,
``..._accepted_tokens_total`` and ``..._accepted_tokens_per_pos``: a kept draft token's
predecessors in its draft were kept, so the counts never grow with the position) and
tpserve's ``spec_decode_paused_steps_total``. State belongs to the engine thread;
``stats`` copies what other threads read.
"""

from __future__ import annotations

from tpserve.server.engine.draft_backoff import DraftBackoff
from tpserve.server.engine.speculative import SpeculativeConfig

COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_paused_steps_total")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


class Drafting:
    """``config`` is ``--speculative-config``; ``backoff`` (None: the default
    ``DraftBackoff``) pauses drafting where it keeps too little."""

    def __init__(self, config: SpeculativeConfig, backoff: DraftBackoff | None = None):
        self.config = config
        self.backoff = backoff or DraftBackoff()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self._kept_this_step = 0  # draft tokens kept since the last ``end_step``

    def describe(self) -> str:
        """The start-up log line."""
        return (f"speculative decoding: {self.config.describe()}; steps run synchronously "
                f"while drafting, which pauses where fewer than {self.backoff.min_kept} "
                "draft tokens a sequence and step are kept")

    def may_draft(self, num_running: int) -> bool:
        """Whether the next step may draft: the backoff is not pausing it and at most
        ``disable_by_batch_size`` sequences run (otherwise steps overlap again)."""
        bound = self.config.disable_by_batch_size
        return self.backoff.probing and (bound is None or num_running <= bound)

    def record(self, draft_len: int, kept: int) -> None:
        """One sequence's verified draft of ``draft_len`` tokens, ``kept`` of them kept
        (the first ``kept`` positions)."""
        c = self.counters
        c["spec_decode_num_drafts_total"] += 1
        c["spec_decode_num_draft_tokens_total"] += draft_len
        c["spec_decode_num_accepted_tokens_total"] += kept
        for j in range(kept):
            self.accepted_per_pos[j] += 1
        self._kept_this_step += kept

    def end_step(self, drafted: bool, sequences: int) -> None:
        """A launched step, ``drafted`` whether it could draft, ``sequences`` the
        sequences it sampled; every ``record`` of it came before (a drafted step is
        finalized before the next is scheduled)."""
        if not self.backoff.probing:
            self.counters["spec_decode_paused_steps_total"] += 1
        self.backoff.record(drafted, sequences, self._kept_this_step)
        self._kept_this_step = 0

    def stats(self) -> dict[str, object]:
        """The counters and a copy of the per-position counts (read by other threads)."""
        return {**self.counters, PER_POSITION: list(self.accepted_per_pos)}

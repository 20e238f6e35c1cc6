"""When drafting does not pay, stop drafting for a while.

While speculative decoding drafts, steps run synchronously (a draft needs the tokens of the
step before), which gives up asynchronous scheduling's overlap of the host's work with the
device's: on an H100 a dummy llama3-8b in bf16 whose drafts were never kept ran 0.89-0.95x
the speed without speculation (``bench/README.md`` round 39). ``DraftBackoff`` watches what
drafting keeps and pauses it where it keeps too little, so steps overlap again, then tries
again.

The rule: drafting runs in probes of ``window`` steps or ``window_sequences`` sampled
sequence-steps, whichever comes first (a batch of 8 judges after 8 steps). A probe that
kept fewer than ``min_kept`` draft tokens per sampled sequence-step (the kept tokens a step
gains over a plain decode step, against the overlap it loses: 5-11 % of a step there)
pauses drafting for ``pause`` launched steps, then a new probe starts. The pause doubles with each probe in
a row that failed, up to ``max_pause``, and a probe that passed resets it; so a workload
whose drafts pay drafts all the time, and one whose drafts never do drafts in about 3 % of
its steps (``window / (window + max_pause)``). Answers do not depend on it: speculation
never changes them.

State (one instance per engine, the engine thread only): ``paused_for`` counts the steps
the current pause has left (0: probing); the probe's steps, sequence-steps and kept tokens
accumulate until ``window`` steps, then are judged and reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 32
WINDOW_SEQUENCES = 64
MIN_KEPT = 0.1
FIRST_PAUSE = 64
MAX_PAUSE = 1024


@dataclass
class DraftBackoff:
    window: int = WINDOW
    window_sequences: int = WINDOW_SEQUENCES
    min_kept: float = MIN_KEPT
    first_pause: int = FIRST_PAUSE
    max_pause: int = MAX_PAUSE
    paused_for: int = field(default=0, init=False)
    pause: int = field(default=0, init=False)  # the next failed probe's (set from first_pause)
    probes_failed: int = field(default=0, init=False)  # cumulative, for the stats
    _steps: int = field(default=0, init=False)
    _sequences: int = field(default=0, init=False)
    _kept: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not (self.window >= 1 and self.window_sequences >= 1 and self.min_kept >= 0
                and 1 <= self.first_pause <= self.max_pause):
            raise ValueError(f"bad draft backoff {self}")
        self.pause = self.first_pause

    @property
    def probing(self) -> bool:
        """Whether the next step may draft (not paused)."""
        return self.paused_for == 0

    def record(self, drafted: bool, sequences: int, kept: int) -> None:
        """One launched step: ``drafted`` whether it could draft (probing, and the engine's
        other conditions held), ``sequences`` the sequences it sampled, ``kept`` the draft
        tokens it kept. A paused step counts the pause down; a drafted one joins the
        probe; a step that could not draft for another reason counts for neither."""
        if self.paused_for:
            self.paused_for -= 1
            return
        if not drafted:
            return
        self._steps += 1
        self._sequences += sequences
        self._kept += kept
        if self._steps < self.window and self._sequences < self.window_sequences:
            return
        if self._kept < self.min_kept * self._sequences:
            self.paused_for = self.pause
            self.pause = min(2 * self.pause, self.max_pause)
            self.probes_failed += 1
        else:
            self.pause = self.first_pause
        self._steps = self._sequences = self._kept = 0

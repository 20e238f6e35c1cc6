"""vLLM's ``repetition_detection``: whether an output has fallen into a loop."""

from __future__ import annotations

from collections.abc import Sequence

from tpserve.model.sampling_params import RepetitionDetection

# the stop reason of an output ended by it (vLLM's; its finish reason is "repetition")
REPETITION_DETECTED = "repetition_detected"


def repeats(tokens: Sequence[int], rule: RepetitionDetection) -> bool:
    """Whether ``tokens`` end in ``rule.min_count`` back-to-back copies of one pattern of
    ``rule.shortest`` to ``rule.max_pattern_size`` tokens: their last ``size * min_count``
    tokens have period ``size``. Checked after each new token, so only the tail matters;
    a size whose span is longer than the output ends the search (longer ones are too)."""
    count = rule.min_count
    for size in range(rule.shortest, rule.max_pattern_size + 1):
        span = size * count
        if span > len(tokens):
            return False
        if tokens[-1] != tokens[-1 - size]:  # the cheap test first: most tails fail it
            continue
        tail = tokens[-span:]
        if tail[size:] == tail[:-size]:
            return True
    return False

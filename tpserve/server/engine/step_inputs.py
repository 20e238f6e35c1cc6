"""A schedule turned into a step's inputs: each scheduled sequence's chunk of tokens, and
which of them the step samples, scores or pools (``EngineCore._step``).

Invariants (asynchronous scheduling, ``engine_core.py``): a chunk that samples and whose
last token is a placeholder names that sequence's row of the in-flight step's samples
(``SeqChunk.pending_src``); any other chunk names none. A broken pairing is a bookkeeping
bug and raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.model.plan import SeqChunk
from tpserve.server.engine.scheduler import ScheduledSeq
from tpserve.server.engine.sequence import Sequence

PLACEHOLDER = -1  # an output token sampled on the device but not read back yet


@dataclass
class StepInputs:
    """One step's chunks in plan order, and the sequences behind its kinds of rows."""

    chunks: list[SeqChunk] = field(default_factory=list)
    sampling: list[Sequence] = field(default_factory=list)  # in row order
    # prompt scoring: (sequence, first position, positions scored) per scored chunk
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # pooling: (sequence, first row, rows, first position, whether it ends the prompt)
    pooled: list[tuple[Sequence, int, int, int, bool]] = field(default_factory=list)
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq_id -> draft


def step_inputs(scheduled: list[ScheduledSeq], pending: dict[int, int]) -> StepInputs:
    """The inputs of a step running ``scheduled``; ``pending`` maps a sequence whose last
    token is a placeholder to its row in the in-flight step's samples."""
    inputs = StepInputs()
    row = 0  # the next chunk's first row in the step
    for item in scheduled:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_new_tokens - len(item.draft)
        sample = end == seq.num_tokens
        tokens = seq.token_slice(start, end) + list(item.draft)
        if item.draft:
            inputs.drafts[seq.seq_id] = item.draft
        first, row = row, row + len(tokens)
        if seq.params.pooling is not None:  # pooled, never sampled
            inputs.pooled.append((seq, first, len(tokens), start, sample))
            inputs.chunks.append(SeqChunk(tokens, start, seq.block_ids, False))
            continue
        src = pending.get(seq.seq_id, -1) if sample else -1
        if (src >= 0) != (tokens[-1] == PLACEHOLDER):
            raise RuntimeError(f"seq {seq.seq_id}: placeholder bookkeeping is broken")
        targets: tuple[int, ...] = ()
        if seq.scores_prompt:  # positions whose next token is still in the prompt
            k = max(0, min(end, seq.num_prompt_tokens - 1) - start)
            targets = tuple(seq.prompt_token_ids[start + 1:start + 1 + k])
            if k:
                inputs.scored.append((seq, start, k))
        lora = seq.params.lora_slot
        inputs.chunks.append(SeqChunk(tokens, start, seq.block_ids, sample, src, targets,
                                      seq.params.prompt_logprobs or 0,
                                      -1 if lora is None else lora, 1 + len(item.draft)))
        if sample:
            inputs.sampling.append(seq)
    return inputs

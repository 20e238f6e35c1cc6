"""Iteration-level scheduler: continuous batching, chunked prefill, preemption by recompute.

Each ``schedule()`` builds one step. Running sequences go first, oldest first, each getting
its next chunk (one token when decoding, otherwise as much of its remaining prefill as the
token budget allows once a token is set aside for every decoding sequence after it, so a
long prefill never starves decodes). While any sequence decodes, the step's budget is
capped at ``max_mixed_tokens`` (when set): steps that carry decodes stay short, which keeps
inter-token latency steady and lets such steps replay CUDA graphs. One sequence's prefill
chunk is at most ``long_prefill_token_threshold`` tokens (when set; vLLM's), so the rest of
the budget goes to the prompts after it. ``max_num_partial_prefills`` (when set; vLLM's)
caps how many sequences get a prefill chunk in one step, and ``max_long_partial_prefills``
how many of them are long (more than ``long_prefill_token_threshold`` tokens left to
compute): a waiting long prompt that finds the long seats taken is passed over, so the
shorter prompts behind it start now instead of queueing behind long ones (``PrefillSeats``).
A running sequence that cannot get KV blocks preempts the
last-ranked running sequence (possibly itself), which frees its blocks and returns to the
waiting queue to recompute later. Then, if nothing was preempted, waiting sequences are
admitted in rank order while the budget, ``max_num_seqs`` and the block pool allow; the
first one that does not fit stops admission. A sequence whose blocks wait for the host
tier's loads (``BlockManager.waits_for_load``) is *held*: running and holding its blocks,
but left out of the steps while any other sequence can run; a step with nothing else
takes it anyway, and that step waits for the loads on the device.

A sequence's rank is ``(priority, seq_id)``: under ``--scheduling-policy fcfs`` (the
default) every priority counts as 0, so the rank is the arrival order; under ``priority``
a lower ``priority`` goes first (vLLM's convention), arrival order within one priority,
and a waiting sequence that does not fit preempts running sequences ranked after it
(last-ranked first, taken out of the step being built) until it fits or none is left.

Queue invariants (checked by ``check_integrity``):
- ``running`` holds RUNNING sequences in increasing rank; ``waiting`` holds WAITING ones
  in increasing rank; under fcfs every running rank is below every waiting rank, except
  the ranks of long prompts passed over (``max_long_partial_prefills``).
  (Admission takes the front of ``waiting``; a preempted sequence is the last-ranked
  running one; new arrivals have the largest ids.) So the first-ranked running sequence
  always gets its blocks, and the scheduler makes progress as long as one sequence of
  ``max_model_len`` tokens fits in the pool; under priority an admission preempts only
  sequences ranked after the one admitted, so the first-ranked sequence overall always
  gets to run.
- Only running sequences hold blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tpserve.model.plan import StepLimits
from tpserve.server.engine.block_manager import BlockManager
from tpserve.server.engine.prefill_seats import PrefillSeats
from tpserve.server.engine.sequence import Sequence, SequenceStatus

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's node of the config tree; every value concrete.

    ``max_mixed_tokens`` is the step budget while sequences decode (None: no cap); the
    server sets it to the largest CUDA-graph mixed bucket when graphs are on. The model
    runner is sized by the same limits (``limits``)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int
    block_size: int = 16
    max_mixed_tokens: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # fcfs | priority (see the module docstring)
    # vLLM's --long-prefill-token-threshold: a prefill chunk of one sequence is at most this
    # many tokens a step, so several long prompts share steps (0: no cap but the budget)
    long_prefill_token_threshold: int = 0
    # vLLM's --max-num-partial-prefills / --max-long-partial-prefills: the sequences that
    # get a prefill chunk in one step, and the long ones among them (0: no cap)
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value!r}")
        if self.max_mixed_tokens is not None and self.max_mixed_tokens <= 0:
            raise ValueError(f"--max-mixed-tokens must be >= 1, got {self.max_mixed_tokens!r}")
        for name in ("long_prefill_token_threshold", "max_num_partial_prefills",
                     "max_long_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value!r}")
        long, num = self.max_long_partial_prefills, self.max_num_partial_prefills
        if long and not self.long_prefill_token_threshold:
            raise ValueError("--max-long-partial-prefills needs --long-prefill-token-"
                             "threshold (the prompt tokens left above which a prefill is long)")
        if long and num and long > num:
            raise ValueError(f"--max-long-partial-prefills {long} exceeds "
                             f"--max-num-partial-prefills {num}")

    @property
    def max_chunk(self) -> int:
        """The most tokens one sequence's prefill chunk may take in a step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def limits(self) -> StepLimits:
        """The bounds the model runner is sized by (checks the block size it supports)."""
        return StepLimits(max_num_seqs=self.max_num_seqs,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          max_model_len=self.max_model_len, block_size=self.block_size)


@dataclass(frozen=True)
class ScheduledSeq:
    """``seq`` computes tokens ``seq.num_computed_tokens .. + num_new_tokens`` this step;
    with a ``draft`` (speculative decoding), its last token and then the draft's tokens,
    ``num_new_tokens == 1 + len(draft)``, every one of them sampled."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """One step: ``scheduled`` lists the first ``num_decodes`` entries as decodes (one new
    token, prompt already computed), then the drafted decodes (a ``draft``: the last token
    and the draft, every position sampled), then prefill chunks; drafted decodes come
    before the prefills so that the plan serves their positions as decodes
    (``StepPlan.build``). ``preempted`` sequences lost their KV this step and wait to
    recompute."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _is_decode(seq: Sequence, num_new_tokens: int) -> bool:
    return num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block manager block_size {block_manager.block_size} != "
                             f"scheduler block_size {config.block_size}")
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < config.max_model_len:
            raise ValueError(f"the KV pool holds {capacity} tokens, less than one sequence of "
                             f"max_model_len={config.max_model_len}; scheduling could stall")
        self.config = config
        self.block_manager = block_manager
        self._running: dict[int, Sequence] = {}  # seq_id -> seq, in increasing rank
        self._waiting: deque[Sequence] = deque()  # in increasing rank
        self._by_priority = config.policy == "priority"
        self._newest_id = -1  # the largest seq_id added
        self._requests: dict[str, list[Sequence]] = {}  # live sequences per request
        # prefix-cache lookups at admission, in tokens (vLLM's prefix_cache_queries/hits):
        # every admitted sequence's tokens are queried; hits are the tokens it got from
        # cached blocks (or, for a sibling, from its parent's prompt blocks)
        self.counters = {"prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}
        # a preempted sequence's re-admissions: its lookups, hits on its own blocks
        # mostly; kept apart and not exported, as vLLM's preempted_queries / _hits
        self.preempted_lookups = {"queries": 0, "hits": 0}

    # ----------------------------------------------------------------- queues

    def rank(self, seq: Sequence) -> tuple[int, int]:
        """The order the scheduler serves ``seq`` in (lowest first)."""
        return (seq.params.priority if self._by_priority else 0, seq.seq_id)

    def _enqueue(self, seq: Sequence) -> None:
        """Puts a WAITING ``seq`` into ``waiting`` at its rank (at either end in O(1),
        which is every case under fcfs)."""
        rank, waiting = self.rank(seq), self._waiting
        if not waiting or rank > self.rank(waiting[-1]):
            waiting.append(seq)
        elif rank < self.rank(waiting[0]):
            waiting.appendleft(seq)
        else:
            waiting.insert(bisect.bisect_left(waiting, rank, key=self.rank), seq)

    def _start_running(self, seq: Sequence) -> None:
        """Adds ``seq`` to ``running`` at its rank."""
        last = self._running[next(reversed(self._running))] if self._running else None
        self._running[seq.seq_id] = seq
        # under priority, or for a long prompt admitted after shorter ones passed it
        if last is not None and self.rank(seq) < self.rank(last):
            self._running = dict(sorted(self._running.items(),
                                        key=lambda item: self.rank(item[1])))

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running.values())

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; its ``seq_id`` must exceed every id added before."""
        if seq.seq_id <= self._newest_id:
            raise ValueError(f"seq_id {seq.seq_id} is not above the newest "
                             f"seq_id {self._newest_id}")
        if seq.status is not SequenceStatus.WAITING or seq.block_ids:
            raise ValueError(f"seq {seq.seq_id} is not a fresh waiting sequence")
        self._enqueue(seq)
        self._newest_id = seq.seq_id
        self._requests.setdefault(seq.request_id, []).append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished with ``status``, take it off the queues, free its blocks."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            del self._running[seq.seq_id]
        else:
            self._waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finish_time = time.monotonic()
        seq.fork_parent = None
        siblings = self._requests.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._requests[seq.request_id]

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every live sequence of ``request_id`` as aborted; returns them."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    # ----------------------------------------------------------------- scheduling

    def schedule(self, token_budget: int | None = None,
                 propose: Callable[[Sequence], tuple[int, ...]] | None = None
                 ) -> SchedulerOutput:
        """Build the next step under ``min(max_num_batched_tokens, token_budget)`` tokens;
        with ``propose`` (speculative decoding), decodes then take the drafts it gives
        them where the step has room (``_add_drafts``)."""
        budget = self.config.max_num_batched_tokens
        if token_budget is not None:
            budget = max(0, min(budget, token_budget))
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        # a decode whose sequence has sampled its last token (pending: asynchronous
        # scheduling) would compute K/V no token ever reads: it finishes when read back
        running = [s for s in self._running.values() if not self._sampled_its_last(s)]
        decoding = sum(1 for s in running if _is_decode(s, s.num_tokens - s.num_computed_tokens))
        cap = self.config.max_mixed_tokens
        if decoding and cap is not None:
            budget = min(budget, max(cap, decoding))

        held: list[Sequence] = []  # waiting for the host tier's loads (block manager)
        seats = PrefillSeats.of(self.config)
        for seq in running:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self.block_manager.waits_for_load(seq):
                held.append(seq)
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            decode, long = _is_decode(seq, left), self._is_long(seq)
            if decode:
                decoding -= 1
                num_new = 1
            elif not seats.allows(long):
                continue  # its next chunk waits for a step with a prefill seat
            else:  # a prefill chunk leaves one token for each decode after it
                num_new = min(left, budget - decoding, self.config.max_chunk)
            if num_new <= 0:
                continue  # nothing to compute until a token is appended, or no room
            grown = self._grow(seq, num_new, scheduled, preempted)
            if grown and not decode:
                seats.take(seq, long)
            budget -= grown

        # Admitting right after a preemption could just take back the victim's blocks.
        if not preempted:
            budget = self._admit(scheduled, preempted, budget, held, seats)
        if not scheduled:  # nothing else to run: the step waits for the loads instead
            for seq in dict.fromkeys(held):  # once each: a victim may be admitted again
                long = self._is_long(seq)
                if (budget > 0 and seq.status is SequenceStatus.RUNNING
                        and seats.allows(long)):
                    left = seq.num_tokens - seq.num_computed_tokens
                    grown = self._grow(seq, min(left, budget, self.config.max_chunk),
                                       scheduled, preempted)
                    if grown:
                        seats.take(seq, long)
                    budget -= grown
        if propose is not None:
            self._add_drafts(scheduled, budget, propose)

        decodes, drafted, prefills = groups = ([], [], [])  # in that order, each in rank
        for item in scheduled:  # order
            groups[0 if _is_decode(item.seq, item.num_new_tokens) else 1 if item.draft
                   else 2].append(item)
        return SchedulerOutput(
            scheduled=decodes + drafted + prefills,
            preempted=preempted,
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
            num_decodes=len(decodes),
        )

    def _is_long(self, seq: Sequence) -> bool:
        """Whether the running ``seq``'s prefill is long: more than
        ``long_prefill_token_threshold`` tokens left to compute (when the threshold is
        set)."""
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < seq.num_tokens - seq.num_computed_tokens

    def _long_at_admission(self, seq: Sequence, fork_tokens: int) -> bool:
        """``_is_long`` of the waiting ``seq`` as admitting it now would leave it: less the
        prompt blocks it would share with its fork parent or find in the prefix cache."""
        threshold = self.config.long_prefill_token_threshold
        if not 0 < threshold < seq.num_tokens:
            return False
        if fork_tokens:
            shared = fork_tokens // self.config.block_size * self.config.block_size
        elif seq.computes_whole_prompt:
            shared = 0
        else:
            shared = self.block_manager.get_computed_blocks(seq.all_token_ids,
                                                            seq.cache_key)[1]
        return seq.num_tokens - shared > threshold

    def _grow(self, seq: Sequence, num_new: int, scheduled: list[ScheduledSeq],
              preempted: list[Sequence]) -> int:
        """Blocks for the running ``seq``'s next ``num_new`` tokens, preempting the
        last-ranked running sequences (possibly ``seq``) until they fit; schedules it and
        returns ``num_new``, or 0 when it was preempted itself."""
        while not self.block_manager.allocate(seq, num_new):
            victim = self._running[next(reversed(self._running))]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return 0
        scheduled.append(ScheduledSeq(seq, num_new))
        return num_new

    def _sampled_its_last(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a decode whose newest token (a pending one) is its last: it
        reached ``max_tokens`` or the model's length, so it needs no further step."""
        return (_is_decode(seq, seq.num_tokens - seq.num_computed_tokens)
                and seq.at_length_limit(self.config.max_model_len))

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int,
                    propose: Callable[[Sequence], tuple[int, ...]]) -> None:
        """Extends the scheduled decodes, in rank order, by their drafts (``propose``)
        while the token budget left, the step's sampled rows (at most ``max_num_seqs``:
        one set aside for every scheduled sequence) and free blocks allow; a draft is cut
        to what fits, and nothing is preempted for one."""
        rows = self.config.max_num_seqs - len(scheduled)
        for i, item in enumerate(scheduled):
            if min(budget, rows) <= 0:
                return
            if not _is_decode(item.seq, item.num_new_tokens):
                continue
            # vLLM counts a draft in its chunk: at most long_prefill_token_threshold
            draft = propose(item.seq)[:min(budget, rows, self.config.max_chunk - 1)]
            while draft and not self.block_manager.allocate(item.seq, 1 + len(draft)):
                draft = draft[:-1]
            if draft:
                scheduled[i] = ScheduledSeq(item.seq, 1 + len(draft), draft)
                budget -= len(draft)
                rows -= len(draft)

    def _admit(self, scheduled: list[ScheduledSeq], preempted: list[Sequence],
               budget: int, held: list[Sequence], seats: PrefillSeats) -> int:
        """Admit waiting sequences in rank order into ``scheduled`` (under priority,
        preempting running ones ranked after them), or into ``held`` where their prefix
        hits wait for the host tier's loads (running, but not in this step unless nothing
        else is), while ``seats`` has a prefill seat. While the long seats are taken, a
        prompt that would be long is passed over (at most ``max_num_seqs`` of them are
        looked at, each step). Returns the budget left."""
        i = 0
        while i < len(self._waiting) and budget > 0 and not seats.full:
            seq = self._waiting[i]
            admitted = None
            if len(self._running) < self.config.max_num_seqs:
                fork_tokens = self._fork_tokens(seq)
                if fork_tokens is None:
                    break  # a sibling waiting for its parent's prompt blocks
                if seats.long_full and self._long_at_admission(seq, fork_tokens):
                    i += 1  # a shorter prompt behind it may start
                    if i >= self.config.max_num_seqs:
                        break
                    continue
                admitted = self._allocate_admission(seq, fork_tokens, budget)
            if admitted is None:  # no seat, or no blocks
                room = self._make_room(seq, scheduled, preempted, seats)
                if room is None:
                    break
                budget += room
                continue
            num_new, hit = admitted
            self._count_lookup(seq, hit)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.fork_parent = None
            del self._waiting[i]
            seq.status = SequenceStatus.RUNNING
            self._start_running(seq)
            if self.block_manager.waits_for_load(seq):
                held.append(seq)
                continue
            scheduled.append(ScheduledSeq(seq, num_new))
            seats.take(seq, self._is_long(seq))
            budget -= num_new
        return budget

    def _count_lookup(self, seq: Sequence, hit: int) -> None:
        """Counts ``seq``'s admission as vLLM's ``record_prefix_cache_stats`` does: only a
        lookup that ran (caching on, the prompt not computed whole), a re-admission after
        preemption apart (``preempted_lookups``) and not in the exported counters."""
        if not self.block_manager.enable_prefix_caching or seq.computes_whole_prompt:
            return
        if seq.num_preemptions:
            self.preempted_lookups["queries"] += seq.num_tokens
            self.preempted_lookups["hits"] += hit
        else:
            self.counters["prefix_cache_queries_total"] += seq.num_tokens
            self.counters["prefix_cache_hits_total"] += hit

    def _allocate_admission(self, seq: Sequence, fork_tokens: int, budget: int
                            ) -> tuple[int, int] | None:
        """Blocks for the waiting ``seq``'s first chunk: its parent's ``fork_tokens``
        prompt tokens shared, else its prefix-cache hits taken. ``(tokens scheduled,
        tokens hit)``, or None (and ``seq`` untouched) when the pool cannot hold them."""
        bm = self.block_manager
        if fork_tokens:
            parent = seq.fork_parent
            assert parent is not None
            bm.fork(parent, seq, fork_tokens)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget,
                          self.config.max_chunk)
            if not bm.allocate(seq, num_new):
                bm.free(seq)
                seq.num_computed_tokens = 0
                return None
            return num_new, fork_tokens
        computed, num_cached = ([], 0) if seq.computes_whole_prompt else \
            bm.get_computed_blocks(seq.all_token_ids, seq.cache_key)
        num_new = min(seq.num_tokens - num_cached, budget, self.config.max_chunk)
        if not bm.allocate(seq, num_new, computed):
            return None
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
        return num_new, num_cached

    def _make_room(self, seq: Sequence, scheduled: list[ScheduledSeq],
                   preempted: list[Sequence], seats: PrefillSeats) -> int | None:
        """Under priority: preempts the last-ranked running sequence if it ranks after
        ``seq`` (taking it out of ``scheduled``, and its prefill seat back), and returns the
        tokens its removal gives back to the budget; None when there is none to preempt."""
        if not self._by_priority or not self._running:
            return None
        victim = self._running[next(reversed(self._running))]
        if self.rank(victim) <= self.rank(seq):
            return None
        freed = 0
        for k, item in enumerate(scheduled):
            if item.seq is victim:
                freed = scheduled.pop(k).num_new_tokens
                seats.give_back(victim)
                break
        self._preempt(victim)
        preempted.append(victim)
        return freed

    def _fork_tokens(self, seq: Sequence) -> int | None:
        """How many prompt tokens ``seq`` can take from its fork parent now: 0 to prefill
        on its own, None to keep waiting for the parent to compute its prompt."""
        parent = seq.fork_parent
        if parent is None:
            return 0
        if parent.scores_prompt and not parent.is_finished:
            return None  # every sibling's first output carries the scored prompt
        bs = self.config.block_size
        wanted = (seq.num_prompt_tokens - 1) // bs * bs
        if wanted == 0 or parent.status is not SequenceStatus.RUNNING:
            seq.fork_parent = None  # nothing to share, or the parent finished / was preempted
            return 0
        return wanted if parent.num_computed_tokens >= wanted else None

    def _preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s KV and put it back at the front of the waiting queue."""
        del self._running[seq.seq_id]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._enqueue(seq)

    def preempt_newest(self, fraction: float = 0.5) -> list[Sequence]:
        """Preempts the last-ranked ``fraction`` of the running sequences (at least one,
        never the first-ranked), e.g. after a step ran out of device memory. Returns
        them."""
        n = len(self._running)
        return self._preempt_last(min(max(1, int(n * fraction)), n - 1))

    def preempt_all(self) -> list[Sequence]:
        """Preempts every running sequence (before the KV pool's content is lost: sleep
        mode); returns them."""
        return self._preempt_last(len(self._running))

    def _preempt_last(self, count: int) -> list[Sequence]:
        running = list(self._running.values())
        victims = running[len(running) - count:] if count > 0 else []
        for seq in reversed(victims):  # last-ranked first, each into waiting at its rank
            self._preempt(seq)
        return victims

    def update(self, output: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Record that ``output``'s step ran: advance computed tokens, append the tokens
        sampled for sequences whose tokens are now all computed, cache full blocks. A
        draft's tokens are not the sequence's yet: only its last token counts as computed
        (``accept_draft_token`` counts the kept ones)."""
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished (e.g. aborted) while the step ran
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            assert seq.num_computed_tokens <= seq.num_tokens, (
                f"seq {seq.seq_id} computed past its tokens")
            if seq.num_computed_tokens == seq.num_tokens and seq.seq_id in sampled:
                seq.append_token(sampled[seq.seq_id])
            self.block_manager.cache_full_blocks(seq, seq.cache_key)

    def accept_draft_token(self, seq: Sequence, token: int) -> None:
        """Appends ``token``, sampled after a kept draft token: the newest token, which the
        step computed as that draft token (its K/V are in the pool), counts as computed."""
        assert seq.num_computed_tokens == seq.num_tokens - 1, (
            f"seq {seq.seq_id}: a draft token kept before its predecessor was read back")
        seq.num_computed_tokens += 1
        seq.append_token(token)
        self.block_manager.cache_full_blocks(seq, seq.cache_key)

    # ----------------------------------------------------------------- checking

    def check_integrity(self) -> None:
        """Raise AssertionError unless queue, sequence and block invariants hold."""
        running, waiting = list(self._running.values()), list(self._waiting)
        ranks = [self.rank(s) for s in running], [self.rank(s) for s in waiting]
        for queue in ranks:
            assert queue == sorted(queue), f"queues out of rank order: {ranks}"
        ids = [s.seq_id for s in running] + [s.seq_id for s in waiting]
        assert len(set(ids)) == len(ids), f"a sequence queued twice: {ids}"
        if not self._by_priority and not self.config.max_long_partial_prefills:
            assert ids == sorted(ids), (f"queues out of seq_id order: running "
                                        f"{ids[:len(running)]}, waiting {ids[len(running):]}")
        assert len(running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        for sid, seq in self._running.items():
            assert sid == seq.seq_id and seq.status is SequenceStatus.RUNNING, (
                f"seq {seq.seq_id} in running with status {seq.status}")
            assert 0 <= seq.num_computed_tokens <= seq.num_tokens, (
                f"seq {seq.seq_id}: computed {seq.num_computed_tokens} of {seq.num_tokens}")
            covered = len(seq.block_ids) * self.config.block_size
            assert covered >= seq.num_computed_tokens, (
                f"seq {seq.seq_id}: {len(seq.block_ids)} blocks cannot hold "
                f"{seq.num_computed_tokens} computed tokens")
        for seq in waiting:
            assert seq.status is SequenceStatus.WAITING, f"seq {seq.seq_id} waiting as {seq.status}"
            assert not seq.block_ids and seq.num_computed_tokens == 0, (
                f"waiting seq {seq.seq_id} holds blocks or computed tokens")
        live = {s.seq_id for s in running} | {s.seq_id for s in waiting}
        by_request = {s.seq_id for seqs in self._requests.values() for s in seqs}
        assert live == by_request, "request index out of sync with the queues"
        self.block_manager.check_integrity(running)

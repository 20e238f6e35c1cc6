"""Scheduler: chunked prefill, limits, FCFS, preemption, n>1 forks, abort, random driver."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.server.engine.fake_kv import FakeKV
from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.block_manager import BlockManager
from tpserve.server.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tpserve.server.engine.sequence import Sequence, SequenceStatus


class Harness:
    """A scheduler plus a fake engine: the "model" samples the step number, and a sequence
    finishes with "length" once it has ``max_tokens`` outputs. Integrity is checked after
    every schedule and every update."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                 max_model_len=None, prefix_caching=False, policy="fcfs", host_slots=0,
                 long_prefill=0, partial=(0, 0)):
        max_model_len = max_model_len or num_blocks * block_size
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, host_slots=host_slots)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, block_size=block_size,
                            policy=policy, long_prefill_token_threshold=long_prefill,
                            max_num_partial_prefills=partial[0],
                            max_long_partial_prefills=partial[1]),
            self.bm)
        self.ids = itertools.count()
        self.steps = 0
        self.seqs: list[Sequence] = []

    def add(self, prompt, max_tokens=4, n=1, request_id=None, priority=0) -> list[Sequence]:
        params = SamplingParams(n=n, max_tokens=max_tokens, priority=priority)
        request_id = request_id or f"req{len(self.seqs)}"
        seqs: list[Sequence] = []
        for index in range(n):
            seq = Sequence(seq_id=next(self.ids), request_id=request_id, index=index,
                           prompt_token_ids=list(prompt), params=params,
                           fork_parent=seqs[0] if seqs else None)
            seqs.append(seq)
            self.sched.add(seq)
        self.sched.check_integrity()
        self.seqs += seqs
        return seqs

    def schedule(self, token_budget=None) -> SchedulerOutput:
        out = self.sched.schedule(token_budget)
        self.sched.check_integrity()
        decode_flags = [s.num_new_tokens == 1
                        and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens
                        for s in out.scheduled]
        assert decode_flags == [i < out.num_decodes for i in range(len(out.scheduled))]
        cfg = self.sched.config  # the prefill seats: the tokens each prefill had left
        prefills = [s.seq.num_tokens - s.seq.num_computed_tokens
                    for s in out.scheduled[out.num_decodes:]]
        if cfg.max_num_partial_prefills:
            assert len(prefills) <= cfg.max_num_partial_prefills, chunks(out)
        if cfg.max_long_partial_prefills:
            longs = sum(left > cfg.long_prefill_token_threshold for left in prefills)
            assert longs <= cfg.max_long_partial_prefills, chunks(out)
        for item in out.scheduled:  # the step's block tables cover its tokens
            assert item.num_new_tokens <= self.sched.config.max_chunk
            seq = item.seq
            assert len(seq.block_ids) * self.bm.block_size >= (
                seq.num_computed_tokens + item.num_new_tokens)
        return out

    def run(self, out: SchedulerOutput) -> None:
        self.steps += 1
        sampled = {s.seq.seq_id: self.steps for s in out.scheduled
                   if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
        self.sched.update(out, sampled)
        self.sched.check_integrity()
        for item in out.scheduled:
            seq = item.seq
            if not seq.is_finished and seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.sched.check_integrity()

    def step(self, token_budget=None) -> SchedulerOutput:
        out = self.schedule(token_budget)
        self.run(out)
        return out


def chunks(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_config_validation():
    with pytest.raises(ValueError, match="--max-num-seqs must be >= 1"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8,
                        block_size=4)
    with pytest.raises(ValueError, match="--block-size must be >= 1"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                        block_size=-4)
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=100,
                                  block_size=4), BlockManager(8, 4, False))


def test_chunked_prefill_splits_prompt_under_budget():
    h = Harness(max_num_batched_tokens=4)
    (a,) = h.add(range(10), max_tokens=3)
    assert chunks(h.step()) == [(0, 4)]
    assert chunks(h.step()) == [(0, 4)]
    assert a.num_output_tokens == 0  # no token sampled from a partial prefill
    out = h.step()
    assert chunks(out) == [(0, 2)] and out.num_decodes == 0
    assert a.output_token_ids == [3]
    out = h.step()
    assert chunks(out) == [(0, 1)] and out.num_decodes == 1
    h.step()
    assert a.finish_reason == "length" and a.output_token_ids == [3, 4, 5]
    assert not h.sched.has_unfinished and h.bm.num_used_blocks == 0


def test_long_prefill_token_threshold_caps_each_prompts_chunk():
    """vLLM's --long-prefill-token-threshold: with room for both, two prompts of 10 and 6
    tokens take at most 4 tokens each a step, instead of the first taking 10 at once; a
    waiting one admitted behind them gets the budget left, also at most 4."""
    h = Harness(max_num_batched_tokens=64, long_prefill=4)
    (a,) = h.add(range(10), max_tokens=2)
    (b,) = h.add(range(20, 26), max_tokens=2)
    assert chunks(h.step()) == [(0, 4), (1, 4)]
    (c,) = h.add(range(30, 39), max_tokens=2)
    assert chunks(h.step(token_budget=9)) == [(0, 4), (1, 2), (2, 3)]
    assert b.output_token_ids == [2] and a.output_token_ids == []
    out = h.step()
    assert chunks(out) == [(1, 1), (0, 2), (2, 4)] and out.num_decodes == 1
    assert chunks(h.step()) == [(0, 1), (2, 2)]  # b finished; a decodes
    with pytest.raises(ValueError, match="--long-prefill-token-threshold must be >= 0"):
        SchedulerConfig(max_model_len=8, long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="--max-num-partial-prefills must be >= 0"):
        SchedulerConfig(max_model_len=8, max_num_partial_prefills=-1)
    with pytest.raises(ValueError, match="--max-long-partial-prefills needs --long-prefill"):
        SchedulerConfig(max_model_len=8, max_long_partial_prefills=1)
    with pytest.raises(ValueError, match="--max-long-partial-prefills 3 exceeds "
                                         "--max-num-partial-prefills 2"):
        SchedulerConfig(max_model_len=8, long_prefill_token_threshold=2,
                        max_num_partial_prefills=2, max_long_partial_prefills=3)
    assert SchedulerConfig(max_model_len=8, max_num_batched_tokens=32).max_chunk == 32


def test_chunks_mix_with_decodes_and_decodes_come_first():
    h = Harness(max_num_batched_tokens=64)
    (a,) = h.add([7], max_tokens=5)
    (b,) = h.add(range(10), max_tokens=5)
    (c,) = h.add([8], max_tokens=5)
    out = h.step(token_budget=5)
    assert chunks(out) == [(0, 1), (1, 4)]  # budget spent: c is not admitted
    out = h.step(token_budget=5)
    assert chunks(out) == [(0, 1), (1, 4)] and out.num_decodes == 1
    out = h.step(token_budget=5)
    assert chunks(out) == [(0, 1), (1, 2), (2, 1)] and out.num_decodes == 1
    assert out.num_batched_tokens == 4
    out = h.step(token_budget=5)
    assert chunks(out) == [(0, 1), (1, 1), (2, 1)] and out.num_decodes == 3
    assert a.output_token_ids == [1, 2, 3, 4]
    assert b.output_token_ids == [3, 4] and c.output_token_ids == [3, 4]


def test_admitted_decode_is_moved_before_an_older_prefill():
    """A recomputing sequence whose tokens are all cached but the last is admitted as a
    decode; it must precede the older sequence's prefill in the step."""
    h = Harness(block_size=2, prefix_caching=True)
    h.add([1, 2, 3, 4, 5], max_tokens=1)
    h.step()  # caches blocks [1, 2] and [3, 4], then finishes
    (x,) = h.add(range(100, 110))
    y = Sequence(seq_id=next(h.ids), request_id="y", index=0, prompt_token_ids=[1, 2, 3],
                 params=SamplingParams(max_tokens=4), output_token_ids=[4, 5])
    h.sched.add(y)
    out = h.schedule()
    assert chunks(out) == [(y.seq_id, 1), (x.seq_id, 10)] and out.num_decodes == 1
    assert y.num_computed_tokens == 4 and y.num_cached_tokens == 4


def test_token_budget_zero_schedules_nothing():
    h = Harness()
    h.add(range(5))
    out = h.step(token_budget=0)
    assert out.is_empty and h.sched.num_waiting == 1


def test_max_num_seqs_respected():
    h = Harness(max_num_seqs=2)
    a, b, c = (h.add([i, i + 1], max_tokens=2)[0] for i in range(3))
    out = h.step()
    assert chunks(out) == [(0, 2), (1, 2)]
    assert (h.sched.num_running, h.sched.num_waiting) == (2, 1)
    out = h.step()  # a and b decode and finish
    assert chunks(out) == [(0, 1), (1, 1)]
    assert a.is_finished and b.is_finished and c.status is SequenceStatus.WAITING
    assert chunks(h.step()) == [(2, 2)]


def test_fcfs_does_not_skip_a_blocked_sequence():
    h = Harness(num_blocks=4, block_size=4)
    h.add(range(12), max_tokens=1)  # 3 blocks
    h.add(range(8))  # 2 blocks: does not fit next to the first
    h.add([1, 2])  # 1 block would fit, but must not jump the queue
    out = h.schedule()
    assert chunks(out) == [(0, 12)]
    assert [s.seq_id for s in h.sched.waiting] == [1, 2]
    h.run(out)  # seq 0 finishes
    assert chunks(h.schedule()) == [(1, 8), (2, 2)]


def test_preemption_recomputes_newest_and_it_finishes_with_all_tokens():
    h = Harness(num_blocks=4, block_size=2, max_model_len=8)
    s0, = h.add([10, 11, 12], max_tokens=4)
    s1, = h.add([20, 21, 22], max_tokens=4)
    assert chunks(h.step()) == [(0, 3), (1, 3)]
    assert (s0.block_ids, s1.block_ids) == ([0, 1], [2, 3])
    assert chunks(h.step()) == [(0, 1), (1, 1)]
    out = h.step()  # s0 needs a third block: the newest, s1, is preempted
    assert out.preempted == [s1] and chunks(out) == [(0, 1)]
    assert s1.status is SequenceStatus.WAITING and s1.num_preemptions == 1
    assert s1.num_computed_tokens == 0 and s1.block_ids == []
    assert s0.block_ids == [0, 1, 2]
    out = h.step()  # s1 needs 3 blocks for its 5 tokens; only 1 is free
    assert chunks(out) == [(0, 1)] and s0.finish_reason == "length"
    out = h.step()  # s1 recomputes prompt + the 2 outputs it had
    assert chunks(out) == [(1, 5)] and out.num_decodes == 0
    h.step()
    assert s0.output_token_ids == [1, 2, 3, 4]
    assert s1.output_token_ids == [1, 2, 5, 6] and s1.finish_reason == "length"
    assert h.bm.num_free_blocks == 4


def test_sequence_needing_blocks_preempts_itself_when_newest():
    h = Harness(num_blocks=4, block_size=2, max_model_len=8)
    s0, = h.add([1, 2, 3], max_tokens=4)  # its next token fits block 1
    s1, = h.add([4, 5, 6, 7], max_tokens=4)  # its next token needs a third block
    h.step()
    out = h.step()
    assert chunks(out) == [(0, 1)] and out.preempted == [s1]
    assert s0.block_ids == [0, 1] and s1.status is SequenceStatus.WAITING


def test_no_admission_in_a_step_that_preempted():
    h = Harness(num_blocks=4, block_size=2, max_model_len=8)
    s0, = h.add([1, 2, 3], max_tokens=4)
    s1, = h.add([4, 5, 6, 7], max_tokens=4)
    h.step()
    h.add([9])  # would fit in the block s1 releases
    out = h.step()
    assert out.preempted == [s1] and chunks(out) == [(0, 1)]
    assert [s.seq_id for s in h.sched.waiting] == [1, 2]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_siblings_fork_the_prompt_blocks(prefix_caching):
    h = Harness(block_size=4, prefix_caching=prefix_caching)
    parent, child = h.add(range(10), max_tokens=2, n=2)
    (other,) = h.add([50, 51, 52], max_tokens=2)
    out = h.step()
    # The sibling waits for its parent's prompt, and FCFS keeps `other` behind it.
    assert chunks(out) == [(0, 10)] and parent.block_ids == [0, 1, 2]
    assert [s.seq_id for s in h.sched.waiting] == [1, 2]
    out = h.schedule()
    # Forked 8 tokens (2 full blocks); only the last 2 prompt tokens are prefilled.
    assert chunks(out) == [(0, 1), (1, 2), (2, 3)]
    assert child.block_ids == [0, 1, 3] and child.fork_parent is None
    assert child.num_cached_tokens == 0
    assert [h.bm.refcount(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    h.run(out)
    while h.sched.has_unfinished:
        h.step()
    assert parent.output_token_ids == [1, 2] and child.output_token_ids == [2, 3]
    assert h.bm.num_used_blocks == 0


def test_sibling_of_finished_parent_prefills_itself_with_prefix_hits():
    h = Harness(block_size=4, prefix_caching=True)
    parent, child = h.add(range(10), max_tokens=1, n=2)
    h.step()
    assert parent.finish_reason == "length"
    out = h.schedule()
    assert chunks(out) == [(1, 2)] and child.num_cached_tokens == 8
    assert child.block_ids == [0, 1, 2] and child.fork_parent is None
    h.run(out)
    assert child.output_token_ids == [2]


def test_short_prompt_siblings_do_not_wait():
    h = Harness(block_size=4)
    parent, child = h.add([1, 2, 3, 4], max_tokens=1, n=2)  # (4-1)//4 = 0 blocks to share
    assert chunks(h.step()) == [(0, 4), (1, 4)]


def test_abort_frees_blocks_and_leaves_other_requests():
    h = Harness(block_size=4)
    p, c = h.add(range(10), n=2, request_id="x", max_tokens=8)
    (other,) = h.add(range(5), request_id="y", max_tokens=8)
    h.step()
    assert h.bm.num_used_blocks == 3
    aborted = h.sched.abort("x")
    h.sched.check_integrity()
    assert aborted == [p, c]
    assert [s.finish_reason for s in aborted] == ["abort", "abort"]
    assert p.block_ids == [] and h.bm.num_used_blocks == 0
    assert h.sched.abort("x") == [] and h.sched.abort("nope") == []
    assert (h.sched.num_running, h.sched.num_waiting) == (0, 1)
    assert chunks(h.step()) == [(2, 5)]


def test_abort_while_step_runs_is_ignored_by_update():
    h = Harness()
    (a,) = h.add(range(5), request_id="x")
    (b,) = h.add(range(6), request_id="y")
    out = h.schedule()
    h.sched.abort("x")
    h.run(out)
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    assert b.num_computed_tokens == 6 and b.output_token_ids == [1]


def test_sequence_without_sampled_token_is_not_rescheduled():
    h = Harness()
    (a,) = h.add([1, 2, 3])
    out = h.schedule()
    h.sched.update(out, {})  # the engine sampled nothing for it
    h.sched.check_integrity()
    assert h.schedule().is_empty
    h.sched.finish(a, SequenceStatus.FINISHED_ERROR)
    assert a.finish_reason == "error" and not h.sched.has_unfinished


def test_a_pending_last_token_is_not_decoded():
    """Asynchronous scheduling appends a sampled token before it is read back. A sequence
    whose pending token is its last (``max_tokens``, or the model's length) gets no decode
    step for it: no token would ever read its K/V; the others decode as before."""
    h = Harness(max_model_len=6)
    (a,) = h.add([1, 2, 3], max_tokens=2)
    (b,) = h.add([4, 5, 6, 7], max_tokens=9)  # 4 + 2 reaches the model's 6
    (c,) = h.add([8, 9], max_tokens=9)
    h.sched.update(h.schedule(), {a.seq_id: 100, b.seq_id: 101, c.seq_id: 102})  # prefill
    out = h.schedule()
    assert chunks(out) == [(a.seq_id, 1), (b.seq_id, 1), (c.seq_id, 1)]
    h.sched.update(out, {a.seq_id: 200, b.seq_id: 201, c.seq_id: 202})
    assert [s.num_output_tokens for s in (a, b, c)] == [2, 2, 2]
    # a and b hold their last tokens, pending; c decodes
    assert chunks(h.schedule()) == [(c.seq_id, 1)]
    h.sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    h.sched.finish(b, SequenceStatus.FINISHED_LENGTH)
    h.sched.check_integrity()


def test_add_rejects_out_of_order_ids():
    h = Harness()
    h.add([1])
    late = Sequence(seq_id=0, request_id="z", index=0, prompt_token_ids=[1],
                    params=SamplingParams())
    with pytest.raises(ValueError, match="seq_id"):
        h.sched.add(late)


def drive(seed: int, prefix_caching: bool, block_size: int = 4, num_blocks: int = 24,
          max_num_seqs: int = 6, max_num_batched_tokens: int = 32, max_model_len: int = 64,
          num_requests: int = 40, max_steps: int = 3000, policy: str = "fcfs",
          host_slots: int = 0, long_prefill: int = 0, partial=(0, 0)) -> Harness:
    """Run random requests (shared prefixes, n in 1..3, random budgets and aborts; under
    the priority policy, priorities -1..2) to completion, checking integrity after every
    step. A fake KV pool checks that every
    token a step attends to sits in the slot its block table names, which catches a wrong
    prefix hit, a bad fork, or two sequences writing one block. With ``host_slots``, it
    runs each step's host-tier copies as the runners do (``FakeKV``), and a load lands in
    its block only at a random later step (rank 0 then sees it done) or when a step joins
    it."""
    rng = random.Random(seed)
    bs = block_size
    h = Harness(num_blocks=num_blocks, block_size=bs, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                prefix_caching=prefix_caching, policy=policy, host_slots=host_slots,
                long_prefill=long_prefill, partial=partial)
    kv = FakeKV(h.bm)
    bases = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    aborted: set[str] = set()
    max_new = max_model_len // 4

    def new_request(i: int) -> None:
        prompt = rng.choice(bases)[:rng.randrange(13)] + [
            rng.randrange(1000) for _ in range(rng.randrange(1, max_model_len // 3))]
        prompt = prompt[:max_model_len - max_new]  # the engine's length check
        h.add(prompt, max_tokens=rng.randrange(1, max_new + 1), n=rng.choice([1, 1, 1, 2, 3]),
              request_id=f"req{i}",
              priority=rng.randrange(-1, 3) if policy == "priority" else 0)

    added = 0
    for _ in range(max_steps):
        while added < num_requests and rng.random() < 0.3:
            new_request(added)
            added += 1
        if added == num_requests and not h.sched.has_unfinished:
            break
        if kv.pending and rng.random() < 0.3:  # a copy stream gets this far; rank 0 sees it
            batch = rng.choice([b for b, _, _ in kv.pending])
            kv.land(batch)
            h.bm.host_loads.complete(batch)
        out = h.schedule(token_budget=rng.choice([None, None, 3, 10]))
        kv.run_copies(item.seq for item in out.scheduled)
        for item in out.scheduled:  # the "model" writes the new tokens' K/V
            seq, start = item.seq, item.seq.num_computed_tokens
            tokens = seq.all_token_ids
            for pos in range(start, start + item.num_new_tokens):
                block, offset = kv.at(seq, pos)
                block[offset] = tokens[pos]
        for item in out.scheduled:  # ... and each sequence attends to exactly its tokens
            seq = item.seq
            end = seq.num_computed_tokens + item.num_new_tokens
            seen = [block[offset] for block, offset in (kv.at(seq, pos) for pos in range(end))]
            assert seen == seq.all_token_ids[:end], f"seq {seq.seq_id} reads wrong KV"
        h.run(out)
        if rng.random() < 0.02 and h.seqs:
            victim = rng.choice(h.seqs).request_id
            aborted.add(victim)
            h.sched.abort(victim)
            h.sched.check_integrity()
    else:
        pytest.fail("requests did not finish")

    assert added == num_requests
    assert h.bm.num_used_blocks == 0 and h.bm.num_free_blocks == num_blocks
    h.bm.check_integrity([])
    for seq in h.seqs:
        assert seq.is_finished
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.params.max_tokens
        else:
            assert seq.finish_reason == "abort" and seq.request_id in aborted
    return h


@pytest.mark.parametrize("seed,prefix_caching", [(0, False), (1, True), (2, True)])
def test_random_driver_runs_every_request_to_completion(seed, prefix_caching):
    h = drive(seed, prefix_caching)
    assert any(s.num_preemptions for s in h.seqs), "the pool was never tight"
    assert any(s.index > 0 and s.num_computed_tokens for s in h.seqs), "no sibling ran"
    if prefix_caching:
        assert any(s.num_cached_tokens for s in h.seqs), "no prefix cache hit"


def test_random_driver_with_a_long_prefill_threshold():
    """Prefill chunks capped at 5 tokens (the harness checks every chunk) under random
    budgets, preemption, siblings, prefix hits and aborts: every request completes."""
    h = drive(4, True, long_prefill=5)
    assert any(s.num_preemptions for s in h.seqs), "the pool was never tight"


@pytest.mark.parametrize("seed,policy", [(7, "fcfs"), (6, "priority")])
def test_random_driver_with_partial_prefill_caps(seed, policy):
    """At most 2 prefill chunks a step, 1 of them long (more than 5 tokens left; the
    harness checks every step), long prompts passed over by shorter ones, under random
    budgets, preemption, siblings, prefix hits and aborts: every request completes."""
    h = drive(seed, True, long_prefill=5, partial=(2, 1), policy=policy)
    assert any(s.num_preemptions for s in h.seqs), "the pool was never tight"
    started = sorted((s for s in h.seqs if s.first_scheduled_time is not None),
                     key=lambda s: s.first_scheduled_time)
    if policy == "fcfs":  # some started before an older prompt: it was passed over
        assert [s.seq_id for s in started] != sorted(s.seq_id for s in started)
    held = drive(seed + 20, True, num_blocks=16, host_slots=12, num_requests=60,
                 policy=policy, long_prefill=5, partial=(2, 1))  # held ones take seats too
    assert held.bm.counters["kv_offload_loaded_blocks_total"] > 0


def test_a_short_prompt_passes_a_long_one_that_finds_the_long_seat_taken():
    """vLLM's --max-num-partial-prefills 2 --max-long-partial-prefills 1 with a threshold of
    4: a is long (20 tokens) and prefills; b, long too, is passed over, and c (3 tokens)
    behind it starts at once; b is admitted in the step where a has 4 tokens left (no
    longer long)."""
    h = Harness(max_num_batched_tokens=64, long_prefill=4, partial=(2, 1))
    (a,) = h.add(range(20), max_tokens=8)
    (b,) = h.add(range(100, 112), max_tokens=2)
    (c,) = h.add(range(200, 203), max_tokens=8)
    assert chunks(h.step()) == [(0, 4), (2, 3)]
    assert h.sched.waiting == [b]
    for _ in range(3):  # a has 16, 12 and 8 tokens left: still long
        assert chunks(h.step()) == [(2, 1), (0, 4)]
    assert chunks(h.step()) == [(2, 1), (0, 4), (1, 4)] and not h.sched.waiting
    h2 = Harness(max_num_batched_tokens=64, partial=(1, 0))  # one prefill a step
    h2.add(range(5), max_tokens=2)
    h2.add(range(10, 15), max_tokens=2)
    assert chunks(h2.step()) == [(0, 5)]
    assert chunks(h2.step()) == [(0, 1), (1, 5)]


def test_a_prompt_is_long_by_the_tokens_it_would_compute():
    """A prompt whose prefix is cached (20 of its 21 tokens) or shared with its fork
    parent computes few tokens: it is not passed over as long while a long prompt holds
    the long seat, and does not take that seat itself."""
    h = Harness(max_num_batched_tokens=64, long_prefill=4, partial=(4, 1),
                prefix_caching=True)
    h.add(range(20), max_tokens=1)
    while h.sched.has_unfinished:
        h.step()
    h.add(range(1000, 1040), max_tokens=2)
    (cached,) = h.add([*range(20), 7], max_tokens=2)
    assert chunks(h.step()) == [(1, 4), (2, 1)] and cached.num_cached_tokens == 20
    s = Harness(max_num_batched_tokens=64, long_prefill=4, partial=(4, 1))
    s.add(range(21), max_tokens=3, n=4)  # the siblings share the parent's 20 tokens
    for _ in range(5):  # the parent's 4-token chunks
        assert chunks(s.step()) == [(0, 4)]
    assert chunks(s.step()) == [(0, 1), (1, 1), (2, 1), (3, 1)] and not s.sched.waiting


def test_a_prefill_preempted_to_make_room_gives_its_seat_back():
    """Under priority, two prompts of a better priority preempt the running prefill; its
    seat comes back, so both start in that step (--max-num-partial-prefills 2)."""
    h = Harness(num_blocks=8, max_model_len=32, policy="priority", partial=(2, 0))
    h.add(range(32), max_tokens=2, priority=2)
    assert chunks(h.step(token_budget=16)) == [(0, 16)]
    h.add(range(100, 104), max_tokens=2, priority=1)
    h.add(range(200, 204), max_tokens=2, priority=1)
    out = h.step()
    assert chunks(out) == [(1, 4), (2, 4)] and [s.seq_id for s in out.preempted] == [0]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_random_driver_on_a_pool_of_one_sequence(prefix_caching):
    """Block size 1, one sequence at a time, a pool that holds exactly max_model_len."""
    drive(3, prefix_caching, block_size=1, num_blocks=24, max_num_seqs=1,
          max_num_batched_tokens=8, max_model_len=24, num_requests=15)


@pytest.mark.parametrize("seed,policy", [(0, "fcfs"), (1, "fcfs"), (2, "fcfs"),
                                         (3, "priority"), (4, "priority"), (5, "priority")])
def test_random_driver_with_a_host_tier_whose_loads_land_later(seed, policy):
    """The driver over a small pool and a host tier: evicted prefixes come back from the
    tier, sequences wait while their loads are on their way (under priority, some are
    preempted while waiting), and every token a step attends to is still its own."""
    h = drive(10 + seed, True, num_blocks=16, host_slots=12, num_requests=60, policy=policy)
    assert h.bm.counters["kv_offload_loaded_blocks_total"] > 0
    assert h.bm.host_loads.next_batch > 0


def test_a_sequence_waits_for_its_loads_while_others_run():
    """A prompt whose prefix is in the host tier is admitted (its blocks taken, its loads
    listed) but left out of the steps while another sequence decodes; once rank 0 saw the
    loads done it is scheduled, and that step joins them. Alone, it is scheduled at once,
    and the step joins its own loads after giving them."""
    h = Harness(num_blocks=8, block_size=4, prefix_caching=True, host_slots=8)
    prompt = list(range(100, 113))  # 3 full blocks and a token
    (first,) = h.add(prompt, max_tokens=1)
    h.step()  # computed and finished: its 3 full blocks cached, evictable
    assert h.bm.take_copies().stores == []
    (filler,) = h.add(list(range(200, 229)), max_tokens=20)  # 8 blocks: evicts all three
    h.step()
    assert len(h.bm.take_copies().stores) == 3
    h.step()  # filler decodes
    h.sched.finish(filler, SequenceStatus.FINISHED_ABORTED)
    (decoder,) = h.add([7, 8], max_tokens=20)
    h.step()
    (again,) = h.add(prompt + [5], max_tokens=2)
    out = h.step()
    assert [item.seq for item in out.scheduled] == [decoder]  # again waits, decoder runs
    assert again.status is SequenceStatus.RUNNING and len(again.block_ids) == 4
    copies = h.bm.take_copies([decoder])
    assert (len(copies.loads), copies.batches, copies.join) == (3, [0, 0, 0], -1)
    for _ in range(2):  # not yet seen done: still held
        out = h.step()
        assert [item.seq for item in out.scheduled] == [decoder]
        copies = h.bm.take_copies([decoder])
        assert (copies.loads, copies.join) == ([], -1)
    h.bm.host_loads.complete(0)
    out = h.step()
    assert [(item.seq, item.num_new_tokens) for item in out.scheduled] == [(decoder, 1),
                                                                           (again, 2)]
    assert h.bm.take_copies([again, decoder]).join == 0  # the step joins the loads
    assert again.num_cached_tokens == 12

    h = Harness(num_blocks=8, block_size=4, prefix_caching=True, host_slots=8)
    (first,) = h.add(prompt, max_tokens=1)
    h.step()
    (filler,) = h.add(list(range(200, 229)), max_tokens=1)
    h.step()
    (again,) = h.add(prompt + [5], max_tokens=2)
    out = h.step()  # nothing else to run: scheduled in the step that loads its blocks
    assert [(item.seq, item.num_new_tokens) for item in out.scheduled] == [(again, 2)]
    copies = h.bm.take_copies([again])
    assert (len(copies.loads), copies.batches, copies.join) == (3, [0, 0, 0], 0)


def test_each_admission_loads_in_a_batch_of_its_own():
    """Two prompts back from the tier admitted in one step: their loads are two batches,
    and the first is computed once its own batch is seen done, the second still waiting."""
    h = Harness(num_blocks=12, block_size=4, prefix_caching=True, host_slots=16)
    prompts = [list(range(100, 109)), list(range(300, 309))]  # 2 full blocks and a token
    for p in prompts:
        h.add(p, max_tokens=1)
        h.step()
    (filler,) = h.add(list(range(500, 547)), max_tokens=20)  # 12 blocks: evicts all four
    h.step()
    h.sched.finish(filler, SequenceStatus.FINISHED_ABORTED)
    (decoder,) = h.add([7, 8], max_tokens=20)
    h.step()
    h.bm.take_copies()
    a, b = (h.add(p + [5], max_tokens=2)[0] for p in prompts)
    out = h.step()
    assert [item.seq for item in out.scheduled] == [decoder]
    copies = h.bm.take_copies([decoder])
    assert (len(copies.loads), copies.batches) == (4, [0, 0, 1, 1])
    h.bm.host_loads.complete(0)
    out = h.step()
    assert [item.seq for item in out.scheduled] == [decoder, a]  # b waits for batch 1
    assert h.bm.take_copies([decoder, a]).join == 0
    h.bm.host_loads.complete(1)
    out = h.step()
    assert b in [item.seq for item in out.scheduled]
    assert h.bm.take_copies([item.seq for item in out.scheduled]).join == 1


def test_prefix_cache_counters_count_tokens_at_admission():
    """vLLM's prefix_cache_queries/hits in tokens: every admission queries the sequence's
    tokens; hits are the cached full blocks it takes (a sibling: its parent's blocks)."""
    h = Harness(block_size=4, prefix_caching=True)
    (a,) = h.add(range(10), max_tokens=1)
    h.step()
    assert h.sched.counters == {"prefix_cache_queries_total": 10, "prefix_cache_hits_total": 0}
    (b,) = h.add([*range(9), 99], max_tokens=1)  # 9 shared tokens: 2 full blocks
    h.step()
    assert b.num_cached_tokens == 8
    assert h.sched.counters == {"prefix_cache_queries_total": 20, "prefix_cache_hits_total": 8}
    parent, child = h.add(range(20, 30), max_tokens=2, n=2)
    while h.sched.has_unfinished:
        h.step()
    assert h.sched.counters == {"prefix_cache_queries_total": 40, "prefix_cache_hits_total": 16}


def test_first_scheduled_time_survives_preemption_and_readmission_does_not_query():
    h = Harness(block_size=4, prefix_caching=False)
    (c,) = h.add(range(6), max_tokens=4)
    (d,) = h.add(range(10, 16), max_tokens=4)
    assert c.first_scheduled_time is None
    h.step()
    first = d.first_scheduled_time
    assert first is not None and c.first_scheduled_time is not None
    assert h.sched.preempt_newest(0.5) == [d]
    h.step()
    assert d.status is SequenceStatus.RUNNING and d.first_scheduled_time == first
    # caching off: no lookup ran, none counts (vLLM's)
    assert h.sched.counters == {"prefix_cache_queries_total": 0, "prefix_cache_hits_total": 0}


def test_only_lookups_that_ran_count_and_a_readmission_is_not_one():
    """As vLLM's ``record_prefix_cache_stats``: a preempted sequence's re-admission (which
    hits its own blocks) and a request that computes its whole prompt (prompt logprobs)
    add no query and no hit."""
    h = Harness(block_size=4, prefix_caching=True)
    (c,) = h.add(range(6), max_tokens=4)
    (d,) = h.add(range(10, 19), max_tokens=4)
    h.step()
    h.step()
    assert h.sched.counters == {"prefix_cache_queries_total": 15, "prefix_cache_hits_total": 0}
    assert h.sched.preempt_newest(0.5) == [d]
    h.step()
    assert d.status is SequenceStatus.RUNNING
    assert h.sched.counters == {"prefix_cache_queries_total": 15, "prefix_cache_hits_total": 0}
    # its 9 prompt and 2 output tokens, its own two full blocks hit
    assert h.sched.preempted_lookups == {"queries": 11, "hits": 8}
    scored = Sequence(seq_id=100, request_id="pl", index=0, prompt_token_ids=list(range(6)),
                      params=SamplingParams(max_tokens=1, prompt_logprobs=1))
    h.sched.add(scored)
    h.step()
    assert scored.first_scheduled_time is not None  # admitted
    assert h.sched.counters == {"prefix_cache_queries_total": 15, "prefix_cache_hits_total": 0}


@pytest.mark.parametrize("seed,prefix_caching", [(4, False), (5, True)])
def test_random_driver_under_the_priority_policy(seed, prefix_caching):
    h = drive(seed, prefix_caching, policy="priority")
    assert any(s.num_preemptions for s in h.seqs), "the pool was never tight"


def first_scheduled(h: Harness) -> list[str]:
    order: list[str] = []
    while h.sched.has_unfinished:
        for item in h.step().scheduled:
            if item.seq.request_id not in order:
                order.append(item.seq.request_id)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_orders_admission_arrival_within_one(policy):
    h = Harness(max_num_seqs=1, policy=policy)
    for name, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        h.add([1, 2, 3], max_tokens=2, request_id=name, priority=priority)
    want = ["c", "a", "d", "b"] if policy == "priority" else ["a", "b", "c", "d"]
    assert first_scheduled(h) == want


def test_a_waiting_request_preempts_a_later_priority_for_blocks():
    """A running low-priority sequence holds the pool; a higher-priority arrival takes
    its blocks in the next step (the victim leaves the step being built), and the victim
    recomputes afterwards and still ends with all its tokens. Under fcfs it waits."""
    for policy in ("priority", "fcfs"):
        h = Harness(num_blocks=4, block_size=4, max_num_seqs=4, policy=policy)
        (low,) = h.add(list(range(12)), max_tokens=4, request_id="low", priority=5)
        h.step()  # low's prompt: 3 blocks
        (high,) = h.add(list(range(8)), max_tokens=2, request_id="high", priority=0)
        out = h.step()
        if policy == "fcfs":
            assert out.preempted == [] and chunks(out) == [(low.seq_id, 1)]
            assert high.status is SequenceStatus.WAITING
            continue
        assert out.preempted == [low] and chunks(out) == [(high.seq_id, 8)]
        assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1
        order = first_scheduled(h)
        assert high.finish_reason == "length" and high.num_output_tokens == 2
        assert order[0] == "high"
        assert low.finish_reason == "length" and low.num_output_tokens == 4


def test_a_waiting_request_preempts_a_later_priority_for_a_seat():
    """max_num_seqs is full of a later priority: one running sequence makes way."""
    h = Harness(max_num_seqs=1, policy="priority")
    (low,) = h.add([1, 2, 3], max_tokens=8, request_id="low", priority=1)
    h.step()
    h.step()
    (high,) = h.add([4, 5], max_tokens=2, request_id="high", priority=0)
    out = h.step()
    assert out.preempted == [low] and chunks(out) == [(high.seq_id, 2)]
    (same,) = h.add([6], max_tokens=2, request_id="same", priority=0)
    out = h.step()  # same priority as the running one: it waits its turn
    assert out.preempted == [] and chunks(out) == [(high.seq_id, 1)]
    assert first_scheduled(h) == ["same", "low"]
    assert low.num_output_tokens == 8 and same.num_output_tokens == 2

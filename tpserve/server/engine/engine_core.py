"""The heart of the engine on rank 0: schedule, run, sample, detokenize, stop.

``EngineCore.step`` is one iteration of continuous batching. It is driven by one thread
only (the engine's ``StepLoop``, in the server process or in the engine process) and has
no locks; everything it touches is its own.

Asynchronous scheduling (the default): step N is launched on the device *before* the
tokens of step N-1 are read back, so the host schedules, builds and launches while the
device still computes, and then detokenizes step N-1 while step N runs. Invariants:
- at most one step is in flight (``_inflight``); its sampling sequences got a placeholder
  token (``PLACEHOLDER``) appended by ``scheduler.update``. A placeholder is never hashed
  (only computed blocks are cached, and a placeholder is computed only by the step after,
  whose update runs after the placeholder was filled in);
- a decode whose input is a placeholder names its row of the in-flight step's samples
  (``SeqChunk.pending_src``), and every rank fills it in on the device;
- ``_finalize`` fills placeholders with the real tokens, then applies stop rules, so a
  sequence that stopped at step N-1 was computed once more at step N; that extra token is
  dropped, and its blocks were freed in between (later steps run after it on the stream);
- rows with penalties need their token history on the host: while any running sequence
  has them, each step is finalized before the next is scheduled (synchronous fallback);
- structured output: a sequence's grammar matcher has accepted exactly its output tokens
  read back so far (placeholders excluded; preemption by recompute keeps the output
  tokens, so the matcher stays valid); with ``structured_after`` exactly those after the
  first gate token, and while ``gated`` it has accepted nothing and masks nothing (an
  undecided gate, ``grammar_gate.py``, masks to the grammar's tokens and the one that
  gates it). A step that samples constrained rows reads back
  the previous step's tokens after its forward is launched and before it samples (the
  device computes meanwhile), advances the matchers, and sends one bitmask for those rows;
  free rows are sampled unmasked and the step is still finalized asynchronously.

A thinking budget (``SamplingParams.thinking``, ``thinking.py``) is counted like a
grammar's tokens: ``RequestState.thinking`` has accepted exactly the sequence's output
tokens read back. A step whose row might have to end its thinking reads the previous
step back before it samples, as constrained rows do, and masks that row to the end tag
when its count is spent; such a sequence gets no draft until its thinking is done.

Speculative decoding (``speculative.py``; ``EngineConfig.speculative``): while it drafts
(``Drafting.may_draft``, ``drafting.py``), each step is finalized as soon as it is
launched, and a step in flight from before is finalized before the next is scheduled (no
placeholders), so a decode's draft is looked up in tokens all read back, and a drafted
sequence's next input is its last kept token, never a pending row. A drafted chunk is the
sequence's last token and its draft, every position sampled (``SeqChunk.sample_rows``);
``update`` counts only the last token as computed and appends one placeholder, which
``_advance`` fills with the first kept token, then appends the others through
``Scheduler.accept_draft_token`` (each counting the kept draft token before it as
computed), applying the stop rules after each.
The K/V written for rejected draft tokens lie past the computed tokens, in the sequence's
own blocks, and are overwritten when those positions are computed. The plan makes each
position of a drafted chunk a decode (``StepPlan.build``). Drafting pauses where its probes
keep too little (``draft_backoff.py``), and steps overlap again meanwhile; ``Drafting``
counts what drafts kept.

Grammars are compiled off the engine thread (``GrammarCompiler`` owns the worker and the
compile futures; this thread only polls them). Invariants:
- a sequence enters the scheduler only with its grammar compiled: a free request, or one
  whose grammar is cached, in ``add``; any other waits in ``awaiting`` (registered in
  ``requests``; ``structured/awaiting.py``) until a step finds its compile done
  (``_admit_ready``, at the start of every step, never blocking; ready ones in arrival
  order). Seq ids are given at admission, so the scheduler's queues keep increasing ids;
- a failed compile ends its request only, with an ``EngineError``; an abort takes the
  request out of ``awaiting`` at once, so it can never be admitted later;
- while requests wait for grammars, ``has_unfinished`` holds and the step loop keeps
  stepping; a step with nothing to run waits on the compiles for at most
  ``GRAMMAR_WAIT_S`` (no spinning, and the inbox is read again soon after);
- their sequences count in ``num_requests_waiting``, and their queue time runs from the
  request's arrival, so it includes the compile.

Prompt scoring (``SamplingParams.prompt_logprobs``, the completions API's ``echo``): the
first sibling computes every prompt position itself (``Sequence.scores_prompt``: no
prefix-cache hits) until its request holds an entry for every prompt token after the
first; a step's entries are read back when the step is finalized, before its sampled
tokens, and a repeated position (after preemption) is skipped. The other siblings are
admitted only after that (``Scheduler._fork_tokens``), so every sibling's first delta
carries the whole scored prompt.

Embeddings (``SamplingParams.pooling``, a pooling runner only): a pooled sequence's chunks
sample nothing; each step's pooled rows (``model.pooling.pool_rows``: its last row, every
row, or its first) are summed on rank 0 and read back when the step is finalized, into the
request's ``pooled`` vector. A sequence is finished as soon as the step computing its last
prompt token is launched (its blocks freed: later steps run after it on the stream), and
its request answered with the embedding when that step is finalized.

Out of device memory: a step is launched as one unit (``_launch``: forward, logits, grammar
bitmask, sampling, the copy of the samples to the host). Nothing outside the engine's own
bookkeeping changes before the unit has succeeded: ``scheduler.update`` (computed tokens,
placeholders, cached blocks) runs only after it, so a step that runs out of memory anywhere
inside it is dropped whole and its sequences simply compute those tokens again; see
``oom_recovery`` for the rest (tp 1 only) and ``OomHold`` for the budget that follows.

Host tier of the prefix cache (``--kv-offloading-size``): the copies a schedule listed
(``BlockManager.take_copies``: the join of earlier loads the step needs, stores of evicted
blocks, then loads of host hits) are handed to every rank just before ``_launch``, outside
the step's unit. They write only host slots and blocks the block manager has already
given them to, so a step dropped after them leaves the cache valid: its sequences find
the loaded blocks cached. Loads run beside the steps: each step first reads, without
waiting, how far rank 0's have got (``HostKV.done_batch``), and the scheduler holds the
sequences still waiting for theirs (``host_loads.py``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from tpserve.model.fault import SAMPLE
from tpserve.model.memory import read_memory
from tpserve.model.plan import StepPlan
from tpserve.model.pooling import classifier_head, pool_rows
from tpserve.model.runner import ModelRunner
from tpserve.model.sampler import PendingSample, Sampler, small_pool_rows
from tpserve.server.engine.block_manager import BlockManager
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.draft_backoff import DraftBackoff
from tpserve.server.engine.drafting import Drafting
from tpserve.server.engine.errors import EngineError
from tpserve.server.engine.grammar_gate import WithToken, first_gate
from tpserve.server.engine.histogram import engine_histograms
from tpserve.server.engine.inflight import (
    InFlight,
    collect_pooled,
    collect_prompt,
    host_copy_event,
    wait_for,
)
from tpserve.server.engine.lora_slots import LoraSlots
from tpserve.server.engine.memory_monitor import MemoryMonitor
from tpserve.server.engine.oom_recovery import recover_from_oom
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput
from tpserve.server.engine.pause import EnginePause
from tpserve.server.engine.request_state import RequestState
from tpserve.server.engine.scheduler import Scheduler, SchedulerConfig
from tpserve.server.engine.sequence import Sequence, SequenceStatus
from tpserve.server.engine.speculative import SampleRows, draft_for, kept_tokens, sample_rows
from tpserve.server.engine.step_inputs import PLACEHOLDER, StepInputs, step_inputs
from tpserve.server.engine.stop_rules import apply_stop_rules, token_logprobs
from tpserve.server.engine.structured.awaiting import AwaitingGrammar
from tpserve.server.engine.structured.bitmask import fill_bitmask
from tpserve.server.engine.structured.compiler import CompileHook, GrammarCompiler
from tpserve.server.engine.thinking import ForcedToken, may_end_thinking
from tpserve.server.engine.token_budget import MemoryReader, TokenBudget
from tpserve.server.engine.token_texts import TokenTexts

logger = logging.getLogger(__name__)

MEMORY_READ_INTERVAL_S = 0.5
# the longest a step with nothing to run waits for a grammar compile (then returns, so the
# step loop reads its inbox and sends heartbeats)
GRAMMAR_WAIT_S = 0.02


class EngineCore:
    """Rank 0's engine. ``read_memory`` is the free-memory reader behind the live token
    budget (``tpserve.model.memory.read_memory``: ``cudaMemGetInfo`` or /proc/meminfo);
    it is read at most every ``memory_read_interval_s`` seconds (0: every step).
    ``compile_hook`` wraps the grammar compiles on the compiler's worker thread
    (``GrammarCompiler``; tests gate or fail them through it). ``close`` ends the worker.
    ``draft_backoff`` (speculative decoding; None: the default ``DraftBackoff``) pauses
    drafting where it keeps too little (``draft_backoff.py``). ``replica``: the
    data-parallel replica's index, added to ``--seed`` for unseeded requests' draws."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, scheduler: SchedulerConfig,
                 engine: EngineConfig | None = None, *,
                 read_memory: MemoryReader = read_memory,
                 memory_read_interval_s: float = MEMORY_READ_INTERVAL_S,
                 compile_hook: CompileHook | None = None,
                 draft_backoff: DraftBackoff | None = None, replica: int = 0):
        engine = engine or EngineConfig()
        if scheduler.limits != runner.limits:
            raise ValueError(f"the runner was sized for {runner.limits}, the scheduler asks "
                             f"for {scheduler.limits}")
        self.runner = runner
        # the LoRA adapter each slot holds (runtime loads and unloads: engine/queries.py)
        lora = runner.cfg.lora
        self.lora_slots = LoraSlots(lora) if lora is not None else None
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # logprob entries' token texts, kept
        self.block_size = scheduler.block_size
        self.max_model_len = scheduler.max_model_len
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens
        host_kv = runner.host_kv
        self.block_manager = BlockManager(runner.kv_pool.num_blocks, scheduler.block_size,
                                          scheduler.enable_prefix_caching,
                                          host_slots=host_kv.num_slots if host_kv else 0)
        self.scheduler = Scheduler(scheduler, self.block_manager)
        cfg = runner.cfg  # vLLM's CacheConfig.metrics_info: /metrics' cache_config_info labels
        self.cache_config = {k: str(v) for k, v in (
            ("block_size", self.block_size), ("cache_dtype", cfg.kv_cache_dtype),
            ("calculate_kv_scales", cfg.calculate_kv_scales),
            ("enable_prefix_caching", scheduler.enable_prefix_caching),
            ("gpu_memory_utilization", cfg.gpu_memory_utilization),
            ("kv_cache_memory_bytes", cfg.kv_cache_memory),
            ("num_gpu_blocks", runner.kv_pool.num_blocks),
            ("num_gpu_blocks_override", cfg.num_gpu_blocks_override))}
        # speculative decoding (``drafting.py``): a draft needs the step before's tokens,
        # so while drafting, steps are finalized before the next is scheduled
        self.async_scheduling = engine.async_scheduling
        self.drafting = None
        if engine.speculative is not None:
            self.drafting = Drafting(engine.speculative, draft_backoff)
            logger.info(self.drafting.describe())
            if scheduler.max_num_seqs == 1:
                logger.warning("--speculative-config with --max-num-seqs 1: a step samples "
                               "at most --max-num-seqs rows and drafts take the rows its "
                               "sequences leave, so nothing is ever drafted; raise "
                               "--max-num-seqs")
        self._inflight: InFlight | None = None
        # the generator of unseeded requests: each data-parallel replica's its own
        # (``--seed`` + its index), so that replicas do not draw the same numbers
        self.sampler = Sampler(runner.cfg.seed + replica, runner.device,
                               engine.logprobs_mode)
        self.pooling = runner.cfg.pooling  # embeddings only; nothing is ever sampled
        self.classifier = classifier_head(getattr(runner, "model", None))  # else None
        if runner.device.type == "cuda" and not self.pooling:  # shapes no start-up step
            # sampled (sampler.py)
            self.sampler.warm_up(runner.model_config.vocab_size,
                                 small_pool_rows(runner.model_config.vocab_size,
                                                 scheduler.max_num_seqs), runner.dtype)
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None
            else set())
        self.grammars = GrammarCompiler(tokenizer, runner.model_config.vocab_size,
                                        self.eos_token_ids, compile_hook=compile_hook)
        self.check_integrity = engine.check_integrity
        # every live request; those still waiting for their grammar are also in
        # ``awaiting`` (arrival order) and have no sequences yet
        self.requests: dict[str, RequestState] = {}
        self.awaiting = AwaitingGrammar(self.grammars)
        self._next_seq_id = 0
        # live readings (exported as metrics); device memory a step needs per batched token
        # is the profiled workspace at the full budget (the room an OOM hold waits for)
        self.budget = TokenBudget(self.max_num_batched_tokens, self.block_size,
                                  runner.plan.workspace // self.max_num_batched_tokens,
                                  read_memory, runner.device, memory_read_interval_s)
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "num_preemptions_total": 0, "steps_total": 0,
                         "oom_recoveries_total": 0, "step_host_seconds_total": 0.0,
                         "device_wait_seconds_total": 0.0,
                         "grammar_wait_seconds_total": 0.0}
        self.histograms = engine_histograms()
        self.memory = MemoryMonitor(runner)  # sampled by the StepLoop between steps
        self.pause = EnginePause()  # /pause and sleep mode (pause.py, control.py)
        self.enable_sleep_mode = engine.enable_sleep_mode

    # ------------------------------------------------------------------ requests
    def add(self, state: RequestState) -> None:
        """Registers a request. A free one, or a constrained one whose grammar is cached,
        enters the scheduler now; any other waits (``awaiting``) while its grammar
        compiles on the compiler's worker, and enters at the first step after the compile
        finished (``_admit_ready``). Raises (having registered nothing) if it cannot start."""
        if (state.params.pooling is not None) != self.pooling:
            raise ValueError("this engine runs a pooling model: it answers embedding "
                             "requests only" if self.pooling else "this engine runs a "
                             "generative model: it cannot answer embedding requests")
        if self.pause.holds:  # paused or asleep: enters at resume (pause.py)
            self.requests[state.request_id] = state
            self.pause.hold(state)
            return
        if self.lora_slots is not None:
            self.lora_slots.check(state.params.lora_slot, state.params.lora_id)
        spec = state.params.structured
        grammar = None if spec is None else self.grammars.request(spec)
        if isinstance(grammar, Future):
            self.requests[state.request_id] = state
            self.awaiting.hold(state, grammar)
            return
        self._admit(state, grammar)

    def _admit(self, state: RequestState, grammar: Any) -> None:
        """Creates the request's sequences (fresh ids, above every queued one) and queues
        them; ``grammar`` is the compiled grammar of a constrained request, else None."""
        matchers = [] if grammar is None else [self.grammars.matcher(grammar)
                                               for _ in range(state.params.n)]
        state.start(self._next_seq_id, self.tokenizer, self.sampler.new_request_generator)
        self._next_seq_id += state.params.n
        state.matchers = matchers
        state.gated = [first_gate(state.params)] * len(matchers)
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self.scheduler.add(seq)
        self.counters["prompt_tokens_total"] += len(state.prompt_token_ids)

    def _admit_ready(self) -> None:
        """Admits, in arrival order, every request whose grammar compile has finished; one
        whose compile failed ends with an ``EngineError`` (as a request that cannot start
        does in ``StepLoop._add``), the others are unaffected. Never blocks."""
        if not self.awaiting:
            return
        for state, future in self.awaiting.pop_ready():
            rid = state.request_id
            try:
                self._admit(state, future.result())
            except Exception as e:  # noqa: BLE001 - isolate the request, keep the engine
                logger.warning("request %s cannot start: %r", rid, e)
                self.scheduler.abort(rid)
                del self.requests[rid]
                state.done = True
                state.emit(EngineError(f"could not start the request: {e!r}"))
        self.grammars.harvest()

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        state.done = True
        if self.awaiting.drop(request_id) or self.pause.drop(request_id):  # no sequences
            state.emit(RequestOutput(request_id, [
                CompletionDelta(i, "", (), None, "abort") for i in range(state.params.n)],
                finished=True, **state.usage()))
            return
        self.scheduler.abort(request_id)
        state.emit(RequestOutput(request_id, [
            CompletionDelta(s.index, "", (), None, "abort") for s in state.seqs
            if s.status == SequenceStatus.FINISHED_ABORTED], finished=True, **state.usage()))

    @property
    def has_unfinished(self) -> bool:
        # an in-flight step whose requests all ended has nothing left to emit; a request
        # waiting for its grammar keeps the engine stepping (``step`` waits for the compile,
        # boundedly, when nothing else can run)
        return bool(self.requests)

    @property
    def wants_step(self) -> bool:
        """Whether the step loop should step: requests to serve, and not paused."""
        return bool(self.requests) and self.pause.may_step

    def close(self) -> None:
        """Stops the grammar compiler's worker (the engine is going away)."""
        self.grammars.close()

    # ----------------------------------------------------------------------- step
    def step(self) -> bool:
        """One iteration: admit the requests whose grammars are ready, schedule and launch
        a step on every rank, then read back the previous step's tokens (or, without
        asynchronous scheduling, this step's) and emit their deltas. With nothing to run
        but requests waiting for their grammar, waits for a compile instead (at most
        ``GRAMMAR_WAIT_S``). Returns whether a step was sent to the ranks. Its time is
        split into waiting for the device (reading back a step's tokens) and everything
        else, the host's own work (both exported as counters); a wait for a compile is
        neither (``grammar_wait_seconds_total``)."""
        start = time.perf_counter()
        c = self.counters
        waited_before = c["device_wait_seconds_total"] + c["grammar_wait_seconds_total"]
        try:
            return self._step()
        finally:
            waited = (c["device_wait_seconds_total"] + c["grammar_wait_seconds_total"]
                      - waited_before)
            c["step_host_seconds_total"] += time.perf_counter() - start - waited

    def resume(self) -> None:
        """Running again (``pause.py``): the requests held meanwhile enter, in arrival
        order; one that cannot start now (its LoRA adapter unloaded) ends with an error."""
        for state in self.pause.release():
            del self.requests[state.request_id]
            try:
                self.add(state)
            except Exception as e:  # noqa: BLE001 - isolate the request, keep the engine
                logger.warning("request %s cannot start: %r", state.request_id, e)
                self.abort(state.request_id)
                state.done = True
                state.emit(EngineError(f"could not start the request: {e!r}"))

    def settle(self) -> None:
        """Reads back the step in flight, if any (its outputs go out), so that nothing is
        in flight: before a pause or sleep takes effect."""
        self._finish_inflight()

    def _step(self) -> bool:
        if not self.pause.may_step:
            return False
        self.budget.refresh()
        self._admit_ready()
        if self.runner.host_kv is not None:  # how far the host tier's loads have got
            self.block_manager.host_loads.complete(self.runner.host_kv.done_batch())
        prev = self._inflight
        drafting = (self.drafting is not None  # a draft needs every token read back
                    and self.drafting.may_draft(self.scheduler.num_running))
        if prev is not None and (drafting or not self._can_overlap()):
            self._finish_inflight()
            prev = None
        ranges = self.runner.ranges
        with ranges.range("schedule"):
            out = self.scheduler.schedule(self.budget.budget,
                                          self._draft if drafting else None)
        self.counters["num_preemptions_total"] += len(out.preempted)
        if out.is_empty:
            if self._inflight is not None:
                self._finish_inflight()  # its outputs go out now, without waiting
            elif not self.scheduler.has_unfinished:
                # nothing can run: wait (boundedly) for one of the pending compiles
                self.counters["grammar_wait_seconds_total"] += self.awaiting.wait(
                    GRAMMAR_WAIT_S)
            return False
        inputs = step_inputs(out.scheduled, prev.rows if prev is not None else {})
        sampling = inputs.sampling
        copies = self.block_manager.take_copies(item.seq for item in out.scheduled)
        if copies.needed:  # the host tier's copies run before the step that needs them
            self.runner.copy_kv(*copies)
        launched = self._launch(inputs)
        if launched is None:  # out of memory: the exception and its frames are gone
            self._recover_from_oom(out.num_batched_tokens)
            return True
        self.counters["steps_total"] += 1
        self.histograms["iteration_tokens_total"].observe(out.num_batched_tokens)
        self._finish_inflight()
        self.scheduler.update(out, {s.seq_id: PLACEHOLDER for s in sampling})
        for seq, _, final, _ in launched.pooling:  # answered when the step is finalized
            if final and seq.status is SequenceStatus.RUNNING:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        launched.rows = {s.seq_id: launched.rows[s.seq_id] for s in sampling
                         if s.status is SequenceStatus.RUNNING
                         and s.output_token_ids and s.output_token_ids[-1] == PLACEHOLDER}
        self._inflight = launched
        if not self.async_scheduling or drafting:  # a drafted step's next inputs are its
            self._finish_inflight()  # last kept tokens, never a pending row
        if self.drafting is not None:
            self.drafting.end_step(drafting, len(sampling))
        if self.check_integrity:
            self.scheduler.check_integrity()
            self.block_manager.check_integrity()
        return True

    def _launch(self, inputs: StepInputs) -> InFlight | None:
        """Runs one step on the device as a unit: forward, logits, grammar bitmask,
        sampling (a row per draft position too: ``inputs.drafts``), and the
        copy of the samples to the host. Returns None when any of it ran out of device
        memory at tp 1; the seeded rows' generators are then back where they were, so a
        seeded request still draws exactly once per token it keeps.

        Nothing of the engine's own state changes in here except reading back the previous
        step (structured rows, rows that may end their thinking), which is valid whether or
        not this step survives."""
        sampling, pooled, drafts = inputs.sampling, inputs.pooled, inputs.drafts
        generators = [self.requests[s.request_id].generators[s.index] for s in sampling]
        rows = sample_rows(sampling, generators, drafts)
        recoverable = self.runner.comm.world_size == 1  # see oom_recovery
        marks = [(g, g.get_state()) for g in generators if g is not None and recoverable]
        try:
            ranges = self.runner.ranges
            with ranges.range("prepare"):  # the plan built, uploaded and sent to every rank
                plan = self.runner.upload(StepPlan.build(inputs.chunks, self.block_size,
                                                         self.runner.attn))
            pool, out_rows = pool_rows([
                (first, n, start, final, seq.params.pooling.pooling_type)
                for seq, first, n, start, final in pooled]) if pooled else (None, [])
            logits = self.runner.run(plan, pool)  # its own "forward" range
            prompt, prompt_event = self.runner.prompt_logprobs, None
            if prompt is not None:  # on its way to the host, read when finalized
                prompt = prompt.to_host()
                prompt_event = host_copy_event(logits)
            sums, sums_event = self.runner.pooled, None
            if sums is not None:
                sums = sums.to("cpu", non_blocking=True)
                sums_event = host_copy_event(logits)
            bitmask = None
            if any(s.params.structured is not None for s in sampling) \
                    or may_end_thinking(sampling, self.requests, PLACEHOLDER):
                # the matchers (or the thinking counts) need the previous step's tokens:
                # read them back now, while the device runs this step's forward
                self._finish_inflight()
                bitmask = self._grammar_bitmask(sampling, rows.first, logits.device)
            with ranges.range("sample"):
                flight = self._sample(logits, sampling, rows, bitmask)
            flight.rows = {s.seq_id: row for s, row in zip(sampling, rows.first, strict=True)}
            flight.drafts = drafts
            flight.scored, flight.prompt, flight.prompt_event = (inputs.scored, prompt,
                                                                 prompt_event)
            flight.pooling = [(seq, start, final, out) for (seq, _, _, start, final), out
                              in zip(pooled, out_rows, strict=True)]
            flight.pooled, flight.pooled_event = sums, sums_event
            return flight
        except torch.OutOfMemoryError:
            if not recoverable:
                raise
            for gen, state in marks:
                gen.set_state(state)
            return None

    def _draft(self, seq: Sequence) -> tuple[int, ...]:
        """A decoding sequence's draft (``speculative.draft_for``); none while its thinking
        is counted against a budget (a draft could run past it)."""
        state = self.requests[seq.request_id]
        if state.thinking and not state.thinking[seq.index].done:
            return ()
        seeded = state.generators[seq.index] is not None
        return draft_for(seq, self.drafting.config, self.max_model_len, seeded)

    def _can_overlap(self) -> bool:
        return self.async_scheduling and not any(
            s.params.needs_output_history for s in self.scheduler.running)

    def _grammar_bitmask(self, sampling: list[Sequence], first: list[int],
                         device: torch.device):
        """The bitmask of the constrained rows that still run (their matchers are up to
        date: the previous step has been read back), and of the rows whose thinking must
        end now (the end tag only: a grammar waits for it, gated, or constrains the whole
        output and wins); ``sampling[i]``'s row is ``first[i]`` (such a sequence has no
        draft). The grammars' rows come first (``TokenBitmask.grammar_rows``)."""
        grammars, forced = [], []
        for row, seq in zip(first, sampling, strict=True):
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:
                continue
            gate = state.gated[seq.index] if state.matchers else True
            if gate is None:  # the first token: the grammar's, or the gated start
                grammars.append((row, WithToken(state.matchers[seq.index],
                                                seq.params.structured_after_if_first)))
            elif not gate:
                grammars.append((row, state.matchers[seq.index]))
            elif state.thinking and state.thinking[seq.index].must_end():
                forced.append((row, ForcedToken(seq.params.thinking.end_id)))
        return fill_bitmask(grammars + forced, self.grammars.vocab_size, device,
                            len(grammars))

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence], rows: SampleRows,
                bitmask=None) -> InFlight:
        """Samples every row on the device and starts copying the results to the host."""
        if not sampling:
            return InFlight([], PendingSample(torch.zeros(0, dtype=torch.int64)), None, {})
        pending = self.sampler.sample(logits, rows.params, rows.prompts, rows.outputs,
                                      rows.generators, self.eos_token_ids, bitmask)
        self.runner.store_sampled(pending.token_ids)
        if self.runner.fault is not None:
            self.runner.fault.fire(self.runner.steps, SAMPLE)
        host = pending.to_host()
        return InFlight(sampling, host, host_copy_event(logits), {})

    def _finish_inflight(self) -> None:
        """Reads back the in-flight step's tokens, fills in the placeholders, applies the
        stop rules and emits the deltas. Sequences that ended meanwhile are skipped."""
        flight, self._inflight = self._inflight, None
        if flight is None or not (flight.sampling or flight.scored or flight.pooling):
            return
        with self.runner.ranges.range("finalize"):
            self._finalize(flight)

    def _finalize(self, flight: InFlight) -> None:
        wait_for(flight.event, self.counters)
        if flight.scored:
            collect_prompt(flight, self.requests, self.counters, self.token_texts)
        if flight.pooling:
            collect_pooled(flight, self.requests, self.counters, self.histograms,
                           self.classifier)
        if not flight.sampling:
            return
        result = flight.sample.resolve()
        touched: dict[str, list[CompletionDelta]] = {}
        for seq in flight.sampling:
            row = flight.rows.get(seq.seq_id)
            if row is None or seq.is_finished:
                continue
            draft = flight.drafts.get(seq.seq_id, ())
            kept = kept_tokens(draft, result.token_ids[row:row + len(draft) + 1])
            if draft:
                self.drafting.record(len(draft), len(kept) - 1)
            first = seq.first_token_time is None
            if first:
                seq.first_token_time = time.monotonic()
            delta = self._advance(seq, row, kept, result)
            if first and seq.params.prompt_logprobs is not None:
                delta = replace(delta, prompt_logprobs=self.requests[
                    seq.request_id].scored_prompt())
            touched.setdefault(seq.request_id, []).append(delta)
        for rid, deltas in touched.items():
            state = self.requests[rid]
            finished = state.all_finished
            state.emit(RequestOutput(rid, deltas, finished=finished, **state.usage()))
            if finished:
                state.done = True
                del self.requests[rid]
                state.observe_times(self.histograms)

    def _recover_from_oom(self, failed_tokens: int) -> None:
        """Reads back the previous step, then ``oom_recovery.recover_from_oom``."""
        self._finish_inflight()
        recover_from_oom(self.scheduler, self.budget, self.runner.device, self.counters,
                         failed_tokens)

    def _advance(self, seq: Sequence, row: int, kept: list[int], result) -> CompletionDelta:
        """Fills the sequence's placeholder with the first ``kept`` token (rows ``row``
        on: the tokens the step keeps, more than one after a kept draft token), then
        takes each in turn: detokenizes it, applies the stop rules (``stop_rules``), and
        finishes the sequence in the scheduler at the first that ends it (the rest are
        dropped)."""
        state = self.requests[seq.request_id]
        text, logprobs, status, reason = [], [], None, None
        for j, token in enumerate(kept):
            if j == 0:
                seq.output_token_ids[-1] = token
            else:  # the token before it was a kept draft token
                self.scheduler.accept_draft_token(seq, token)
            self.counters["generation_tokens_total"] += 1
            piece, status, reason = apply_stop_rules(seq, state, self.eos_token_ids,
                                                     self.max_model_len)
            text.append(piece)
            logprobs.extend(token_logprobs(seq, row + j, result, self.token_texts) or ())
            if status is not None:
                seq.stop_reason = reason
                self.scheduler.finish(seq, status)
                break
        return CompletionDelta(seq.index, "".join(text), tuple(kept[:j + 1]),
                               tuple(logprobs) or None,
                               seq.finish_reason if status else None, reason)

    def fail_all(self, error: BaseException) -> None:
        """Ends every request with ``error`` (the engine is going down)."""
        self._inflight = None
        self.awaiting.drop_all()
        self.pause.held.clear()
        for state in list(self.requests.values()):
            state.done = True
            state.emit(error)
        self.requests.clear()

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            # sequences waiting for their grammar are waiting too (their queue time, from
            # the request's arrival to its first step, includes the compile)
            "num_requests_waiting": (self.scheduler.num_waiting + self.awaiting.num_sequences
                                     + self.pause.num_held_sequences),
            "engine_paused": float(not self.pause.may_step),
            "engine_sleep_level": self.runner.sleep_state.level,
            "kv_cache_usage_perc": bm.usage,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached": bm.num_cached_free_blocks,
            "device_memory_free_bytes": self.budget.free,
            "step_token_budget": self.budget.budget,
            **self.counters,
            **({} if self.drafting is None else self.drafting.stats()),
            **self.scheduler.counters,
            **({} if bm.host is None else {"kv_offload_blocks_total": bm.host.num_slots,
                                           "kv_offload_blocks_used": bm.host.num_used,
                                           **bm.counters}),
            **{k: v for h in self.histograms.values() for k, v in h.export().items()},
            # other threads call this: ``running`` and ``waiting`` are copied in one C call
            # each (atomic under the GIL), then read
            **({} if self.lora_slots is None else {"lora": self.lora_slots.stats(
                self.scheduler.running, self.scheduler.waiting)}),
            "cache_config": self.cache_config,
        }


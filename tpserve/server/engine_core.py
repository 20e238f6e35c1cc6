"""The synchronous heart of the engine on rank 0: schedule, run, sample, detokenize, stop.

``EngineCore.step`` is one iteration of continuous batching. It is driven by one thread
only (``AsyncEngine``'s loop) and has no locks; everything it touches is its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tpserve.model.memory import read_memory
from tpserve.model.plan import SeqChunk, StepPlan
from tpserve.model.runner import ModelRunner
from tpserve.model.sampler import Sampler
from tpserve.server.block_manager import BlockManager
from tpserve.server.outputs import CompletionDelta, RequestOutput, TokenLogprob
from tpserve.server.request_state import RequestState
from tpserve.server.scheduler import Scheduler, SchedulerConfig
from tpserve.server.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

MEMORY_READ_INTERVAL_S = 0.5


class EngineCore:
    def __init__(self, runner: ModelRunner, tokenizer: Any, *, enable_prefix_caching: bool,
                 seed: int = 0, check_integrity: bool = False):
        cfg = runner.cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_size = cfg.block_size
        self.max_model_len = runner.max_model_len
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.block_manager = BlockManager(runner.kv_pool.num_blocks, cfg.block_size,
                                          enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
                            cfg.block_size), self.block_manager)
        self.sampler = Sampler(seed, runner.device)
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids) | (
            {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None
            else set())
        self.check_integrity = check_integrity
        self.requests: dict[str, RequestState] = {}
        self._next_seq_id = 0
        # live readings (exported as metrics)
        self.free_device_memory, _ = read_memory(runner.device)
        self.memory_floor = max(min(self.free_device_memory, 1 << 30), 1)
        self.token_budget = self.max_num_batched_tokens
        self._last_read = 0.0
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0,
                         "num_preemptions_total": 0, "steps_total": 0,
                         "oom_recoveries_total": 0}

    # ------------------------------------------------------------------ requests
    def add(self, state: RequestState) -> None:
        state.start(self._next_seq_id, self.tokenizer, self.sampler.new_request_generator)
        self._next_seq_id += state.params.n
        self.requests[state.request_id] = state
        for seq in state.seqs:
            self.scheduler.add(seq)
        self.counters["prompt_tokens_total"] += len(state.prompt_token_ids)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.scheduler.abort(request_id)
        state.done = True
        state.emit(RequestOutput(request_id, [
            CompletionDelta(s.index, "", (), None, "abort") for s in state.seqs
            if s.status == SequenceStatus.FINISHED_ABORTED], finished=True, **state.usage()))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- live sizing
    def _read_live_memory(self) -> None:
        """Re-reads free device memory (at most every 0.5 s) and sizes the step's token
        budget: the full budget while free memory stays above the start-up floor, shrinking
        proportionally below it (another process is taking memory)."""
        now = time.monotonic()
        if now - self._last_read < MEMORY_READ_INTERVAL_S:
            return
        self._last_read = now
        self.free_device_memory, _ = read_memory(self.runner.device)
        ratio = min(self.free_device_memory / self.memory_floor, 1.0)
        self.token_budget = max(self.block_size, int(self.max_num_batched_tokens * ratio))

    # ----------------------------------------------------------------------- step
    def step(self) -> None:
        """One iteration: schedule, run the model on every rank, sample, emit deltas."""
        self._read_live_memory()
        out = self.scheduler.schedule(self.token_budget)
        self.counters["num_preemptions_total"] += len(out.preempted)
        if out.is_empty:
            return
        chunks, sampling = [], []
        for item in out.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            sample = end == seq.num_tokens
            chunks.append(SeqChunk(seq.token_slice(start, end), start, seq.block_ids, sample))
            if sample:
                sampling.append(seq)
        try:
            logits = self.runner.execute(StepPlan.build(chunks, self.block_size))
        except torch.OutOfMemoryError:
            self._recover_from_oom()
            return
        self.counters["steps_total"] += 1
        sampled: dict[int, int] = {}
        result = None
        if sampling:
            states = [self.requests[s.request_id] for s in sampling]
            result = self.sampler(
                logits, [s.params for s in sampling], [s.prompt_token_ids for s in sampling],
                [s.output_token_ids for s in sampling],
                [st.generators[s.index] for st, s in zip(states, sampling, strict=True)],
                self.eos_token_ids)
            sampled = {s.seq_id: t for s, t in zip(sampling, result.token_ids, strict=True)}
        self.scheduler.update(out, sampled)
        self.counters["generation_tokens_total"] += len(sampled)
        touched: dict[str, list[CompletionDelta]] = {}
        for row, seq in enumerate(sampling):
            delta = self._advance(seq, row, result)
            if delta is not None:
                touched.setdefault(seq.request_id, []).append(delta)
        for rid, deltas in touched.items():
            state = self.requests[rid]
            finished = state.all_finished
            state.emit(RequestOutput(rid, deltas, finished=finished, **state.usage()))
            if finished:
                state.done = True
                del self.requests[rid]
        if self.check_integrity:
            self.scheduler.check_integrity()
            self.block_manager.check_integrity()

    def _recover_from_oom(self) -> None:
        """A step ran out of device memory before any collective (tp 1, or the failure hit
        every rank alike): nothing was computed, so the step is dropped, the newest half of
        the running sequences is preempted and the token budget halved for a while."""
        if self.runner.comm.world_size > 1:
            raise  # ranks may have diverged mid-step: not recoverable in place
        victims = self.scheduler.preempt_newest(0.5)
        self.counters["num_preemptions_total"] += len(victims)
        self.counters["oom_recoveries_total"] += 1
        self.token_budget = max(self.block_size, self.token_budget // 2)
        self._last_read = time.monotonic() + 5.0  # keep the halved budget ~5 s
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.warning("step ran out of memory: preempted %d sequences, token budget %d",
                       len(victims), self.token_budget)

    def _advance(self, seq: Sequence, row: int, result) -> CompletionDelta | None:
        """Detokenizes the sequence's new token and applies the stop rules."""
        state = self.requests[seq.request_id]
        detok = state.detoks[seq.index]
        token = seq.output_token_ids[-1]
        params = seq.params
        text = detok.add_token(token)
        status, reason = None, None
        n_out = seq.num_output_tokens
        if detok.stopped:
            status, reason = SequenceStatus.FINISHED_STOPPED, detok.stop_reason
        elif n_out >= params.min_tokens and token in params.stop_token_ids:
            status, reason = SequenceStatus.FINISHED_STOPPED, token
        elif (n_out >= params.min_tokens and not params.ignore_eos
              and token in self.eos_token_ids):
            status = SequenceStatus.FINISHED_STOPPED
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if not detok.stopped:
                text += detok.flush()
            seq.stop_reason = reason
            self.scheduler.finish(seq, status)
        logprobs = None
        if params.logprobs is not None and result is not None:
            top = tuple((t, detok.token_text(t), lp) for t, lp in result.top_logprobs[row])
            logprobs = (TokenLogprob(token, detok.token_text(token), result.logprobs[row],
                                     top),)
        return CompletionDelta(seq.index, text, (token,), logprobs,
                               seq.finish_reason if status else None, reason)

    def fail_all(self, error: BaseException) -> None:
        """Ends every request with ``error`` (the engine is going down)."""
        for state in list(self.requests.values()):
            state.done = True
            state.emit(error)
        self.requests.clear()

    def stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": bm.usage,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached": bm.num_cached_free_blocks,
            "device_memory_free_bytes": self.free_device_memory,
            "step_token_budget": self.token_budget,
            **self.counters,
        }

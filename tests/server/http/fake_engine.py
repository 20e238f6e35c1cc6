"""A deterministic in-process ``EngineClient`` for HTTP-layer tests.

Every sibling emits a fixed cyclic token sequence (sibling ``i`` starts ``i`` tokens in),
honouring max_tokens, min_tokens, stop_token_ids, stop strings, ignore_eos and logprobs. It
can be told to fail (``fail``), slowed down (``step_delay``) and records what it was asked
to do (``started``, ``params``, ``prompts``) and every abort (``aborted``, ``closed_early``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tpserve.model.sampling_params import SamplingParams
from tpserve.server.engine.errors import EngineDeadError, EngineOverloadedError
from tpserve.server.engine.histogram import engine_histograms
from tpserve.server.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob

TEXT = " The quick brown fox jumps over the lazy dog."
FAIL_MODES = (None, "overload", "dead", "midway", "crash", "error_output")


class _Sibling:
    def __init__(self, index: int):
        self.index = index
        self.ids: list[int] = []
        self.text = ""
        self.finished = False


class FakeEngine:
    def __init__(self, tokenizer: Any, *, model_name: str = "fake/smollm2-135m",
                 max_model_len: int = 256):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.sequence = tokenizer.encode(TEXT, add_special_tokens=False)
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = frozenset({tokenizer.eos_token_id})
        self.reset()

    def reset(self) -> None:
        self.accepting = True
        self.dead_reason: str | None = None
        self.healthy = True
        self.fail: str | None = None
        self.retry_after = 7
        self.step_delay = 0.0
        self.cached_tokens = 0
        self.started: list[str] = []
        self.params: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.closed_early: list[str] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ EngineClient

    def is_healthy(self) -> bool:
        return self.healthy and self.dead_reason is None

    def pinned(self, prompt_token_ids: list[int], params: SamplingParams) -> FakeEngine:
        return self

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict[str, float]:
        return {
            "num_requests_running": 1.0, "num_requests_waiting": 2.0,
            "kv_cache_usage_perc": 0.25, "kv_blocks_total": 100.0, "kv_blocks_free": 75.0,
            "kv_blocks_cached": 5.0, "num_preemptions_total": 3.0,
            "prompt_tokens_total": float(self.prompt_tokens_total),
            "generation_tokens_total": float(self.generation_tokens_total),
            "device_memory_allocated_bytes": 1e9, "device_memory_reserved_bytes": 2e9,
            "device_memory_free_bytes": 3e9, "step_token_budget": 2048.0,
            "prefix_cache_queries_total": 40.0, "prefix_cache_hits_total": 16.0,
            **self.histograms(),
        }

    @staticmethod
    def histograms() -> dict[str, float]:
        """The engine's own histograms as its stats() carries them: steps of 1, 8 and 9
        tokens, one request that queued 0.4 s, prefilled 1.2 s and decoded 3 s."""
        out: dict[str, float] = {}
        for name, h in engine_histograms().items():
            values = {"iteration_tokens_total": (1, 8, 9),
                      "request_queue_time_seconds": (0.4,),
                      "request_prefill_time_seconds": (1.2,),
                      "request_decode_time_seconds": (3.0,)}[name]
            for v in values:
                h.observe(v)
            out.update(h.export())
        return out

    def token_at(self, sibling: int, step: int) -> int:
        return self.sequence[(sibling + step) % len(self.sequence)]

    def logprob_of(self, token_id: int, k: int) -> TokenLogprob:
        top = tuple((alt, self.tokenizer.decode([alt]), -1.0 - j)
                    for j, alt in enumerate((token_id + 1 + j) % self.vocab_size
                                            for j in range(k)))
        return TokenLogprob(token_id, self.tokenizer.decode([token_id]), -0.5, top)

    def job(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams) -> None:
        """A request started: its id, parameters and prompt, for the tests to read."""
        self.started.append(request_id)
        self.params[request_id] = params
        self.prompts[request_id] = list(prompt_token_ids)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, in_job: bool = False
                       ) -> AsyncIterator[RequestOutput]:
        self.record(request_id, prompt_token_ids, params)
        if self.fail == "overload":
            raise EngineOverloadedError("too many requests waiting", retry_after=self.retry_after)
        if self.fail == "dead":
            raise EngineDeadError("rank 1 died")
        if self.fail == "crash":
            raise RuntimeError("fake engine crashed")
        siblings = [_Sibling(i) for i in range(params.n)]
        finished = False
        self.prompt_tokens_total += len(prompt_token_ids)
        try:
            step = 0
            while not all(s.finished for s in siblings):
                await asyncio.sleep(self.step_delay)
                if self.fail == "midway" and step == 2:
                    raise EngineDeadError("engine died mid-request")
                if self.fail == "error_output" and step == 1:
                    yield RequestOutput(request_id, [], error="sampler produced NaN")
                    return
                deltas = [self._advance(s, step, params) for s in siblings if not s.finished]
                step += 1
                done = all(s.finished for s in siblings)
                out = RequestOutput(request_id, deltas)
                if done:
                    out.finished = True
                    out.num_prompt_tokens = len(prompt_token_ids)
                    out.num_output_tokens = sum(len(s.ids) for s in siblings)
                    out.num_cached_tokens = self.cached_tokens
                    finished = True
                yield out
        finally:
            if not finished:
                self.closed_early.append(request_id)
                self.abort(request_id)

    # ------------------------------------------------------------------ internals

    def _advance(self, s: _Sibling, step: int, params: SamplingParams) -> CompletionDelta:
        token = self.token_at(s.index, step)
        s.ids.append(token)
        self.generation_tokens_total += 1
        finish: str | None = None
        stop_reason: str | int | None = None
        may_stop = len(s.ids) > params.min_tokens
        if may_stop and token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif may_stop and not params.ignore_eos and token == self.tokenizer.eos_token_id:
            finish = "stop"
        text_ids = s.ids[:-1] if finish else s.ids
        full = self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens)
        if finish is None and may_stop:
            for stop in params.stop:
                cut = full.find(stop)
                if cut >= 0:
                    end = cut + len(stop) if params.include_stop_str_in_output else cut
                    full, finish, stop_reason = full[:end], "stop", stop
                    break
        if finish is None and len(s.ids) >= params.max_tokens:
            finish = "length"
        delta_text = full[len(s.text):] if full.startswith(s.text) else ""
        s.text = full if full.startswith(s.text) else s.text
        s.finished = finish is not None
        lps = None
        if params.logprobs is not None:
            lps = (self.logprob_of(token, params.logprobs),)
        return CompletionDelta(s.index, delta_text, (token,), lps, finish, stop_reason)

    def expected_ids(self, sibling: int, count: int) -> list[int]:
        return [self.token_at(sibling, t) for t in range(count)]

    def expected_text(self, sibling: int, count: int) -> str:
        return self.tokenizer.decode(self.expected_ids(sibling, count))

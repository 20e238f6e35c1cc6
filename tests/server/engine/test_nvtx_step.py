"""NVTX ranges through real engine steps on CPU: with a recording push/pop pair handed to
the runner, every step is named (schedule, prepare, forward, sample; finalize when the
previous step's tokens are read back), the ranges never nest at tp 1 and always balance."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_nvtx import Recorder
from tests.server.engine.test_engine_core import submit, tokens_of
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.scheduler import SchedulerConfig

STEP = ["schedule", "prepare", "forward", "sample"]


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


def _core(folder, tokenizer, ranges, async_scheduling: bool) -> EngineCore:
    cfg = RunnerConfig(model=folder, kv_cache_memory=64 * 2**20)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                            block_size=16)
    runner = ModelRunner(cfg, sched.limits, TPGroup(0, 1, torch.device("cpu"), None),
                         ranges=ranges)
    return EngineCore(runner, tokenizer, sched,
                      EngineConfig(check_integrity=True, async_scheduling=async_scheduling))


def _steps(core: EngineCore, rec: Recorder) -> list[list[str]]:
    """Runs ``core`` to the end; the range names of each ``step`` call."""
    per_step = []
    for _ in range(100):
        if not core.has_unfinished:
            break
        start = len(rec.events)
        core.step()
        assert rec.depth == 0, "a step left a range open"
        events = rec.events[start:]
        depth = 0
        for e in events:  # at tp 1 nothing nests (collectives are no-ops)
            depth += 1 if e[0] == "push" else -1
            assert depth in (0, 1)
        per_step.append([e[1] for e in events if e[0] == "push"])
    assert not core.has_unfinished
    return per_step


def test_each_step_is_named_and_balanced_with_async_scheduling(folder, smollm2_tokenizer):
    rec = Recorder()
    core = _core(folder, smollm2_tokenizer, rec.ranges(), async_scheduling=True)
    outs = submit(core, "a", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=3,
                                                                ignore_eos=True))
    steps = _steps(core, rec)
    assert len(tokens_of(outs)) == 3
    # step 1 prefills (40 tokens, one chunk) and samples; every later step also reads back
    # the step before it; step 3 samples the last token, so the 4th launches nothing (no
    # decode of a token no one reads) and only reads it back, which ends the request
    assert steps == [STEP] + [[*STEP, "finalize"]] * 2 + [["schedule", "finalize"]]


def test_each_step_is_named_and_balanced_without_async_scheduling(folder, smollm2_tokenizer):
    rec = Recorder()
    core = _core(folder, smollm2_tokenizer, rec.ranges(), async_scheduling=False)
    # 70 prompt tokens over a 64-token budget: a chunk that samples nothing, then one that does
    outs = submit(core, "a", list(range(3, 73)), SamplingParams(temperature=0, max_tokens=2,
                                                                ignore_eos=True))
    steps = _steps(core, rec)
    assert len(tokens_of(outs)) == 2
    assert steps == [STEP, [*STEP, "finalize"], [*STEP, "finalize"]]

"""Sleep mode on the GPU, at the runner (``model/sleep.py``): a sleep gives the weights', the
KV pool's and the CUDA graphs' memory back to the device (``cudaMemGetInfo`` sees it), a
wake-up takes it back, captures the graphs again and the same step gives the same logits
from a replayed graph; a wake-up that finds too little free memory leaves every storage
empty and can be retried, as does one with room for the weights and the pool but not the
graphs. (The CPU tests: ``tests/server/engine/test_sleep_engine.py``.)"""

from __future__ import annotations

import pytest
import torch

from tpserve.model.plan import SeqChunk, StepLimits, StepPlan
from tpserve.model.sleep import SleepError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="device memory given back: GPU only")


def _runner():
    """A fresh runner, once the runners of earlier tests are gone: their cycles collected
    (a streamed-weights runner unlocks its host memory then) and their cached blocks given
    back, so that this test's device-memory readings are its own."""
    import gc

    from tpserve.model.runner import ModelRunner
    from tpserve.model.runner_config import RunnerConfig
    from tpserve.parallel.state import TPGroup

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()

    cfg = RunnerConfig(model="smollm2-135m", load_format="dummy", dtype="bfloat16",
                       device="cuda", kernel_backend="triton", kv_cache_memory=512 * 2**20,
                       cuda_graph_max_tokens=128)
    limits = StepLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512,
                        block_size=16)
    return ModelRunner(cfg, limits, TPGroup(0, 1, torch.device("cuda", 0), None))


def _logits(runner) -> torch.Tensor:
    plan = StepPlan.build([SeqChunk(list(range(5, 45)), 0, [0, 1, 2], True)], 16,
                          runner.attn)
    assert runner.graphs.can_run(plan)  # replayed from a graph
    out = runner.execute(plan).float().cpu()
    torch.cuda.synchronize()
    return out


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_wake_up_replays_the_same_logits(level):
    runner = _runner()
    before = _logits(runner)
    free_awake = _free()
    (figures,) = runner.sleep(level)
    held = figures["weights_bytes"] + figures["kv_cache_bytes"] + figures["cuda_graph_bytes"]
    assert figures["kv_cache_bytes"] == runner.plan.kv_pool
    assert figures["host_copy_bytes"] == (figures["weights_bytes"] if level == 1 else 0)
    assert _free() - free_awake >= 0.95 * held
    (woke,) = runner.wake_up(True, True)
    assert woke["cuda_graph_bytes"] > 0 and runner.graphs is not None
    assert torch.equal(_logits(runner), before)


def test_a_wake_up_without_room_stays_asleep_and_can_be_retried():
    runner = _runner()
    before = _logits(runner)
    runner.sleep(1)
    blocker = torch.empty(torch.cuda.mem_get_info()[0] - 64 * 2**20, dtype=torch.uint8,
                          device="cuda")
    with pytest.raises(SleepError, match="wake-up failed on a rank .*out of memory"):
        runner.wake_up(True, True)
    state = runner.sleep_state
    assert state.weights_asleep and state.kv_asleep and state.level == 1
    assert all(p.untyped_storage().nbytes() == 0 for p in runner.model.parameters())
    del blocker
    torch.cuda.empty_cache()
    runner.wake_up(True, True)
    assert torch.equal(_logits(runner), before)


def test_a_wake_up_without_room_for_the_graphs_stays_asleep():
    """Room for the weights and the pool but not for the graphs' reserve: refused before
    any capture (a capture out of memory could leave ranks out of step), still asleep."""
    runner = _runner()
    before = _logits(runner)
    runner.sleep(2)
    plan = runner.plan
    room = plan.weights + plan.kv_pool + plan.graphs_reserve // 4
    blocker = torch.empty(torch.cuda.mem_get_info()[0] - room, dtype=torch.uint8,
                          device="cuda")
    with pytest.raises(SleepError, match="the CUDA graphs need about") as e:
        runner.wake_up(True, True)
    assert e.value.out_of_memory and runner.sleep_state.level == 2
    assert runner.kv_pool.buffer.untyped_storage().nbytes() == 0
    del blocker
    torch.cuda.empty_cache()
    runner.wake_up(True, True)
    assert torch.equal(_logits(runner), before)


def test_a_reload_reads_the_weights_under_the_captured_graphs():
    """``reload_weights`` writes the same storages: the graphs captured at start-up replay
    with the weights read again (spoiled ones first, so a graph still reading them would
    show)."""
    runner = _runner()
    before = _logits(runner)
    graphs = runner.graphs
    for p in runner.model.parameters():
        p.data.mul_(0.5)
    assert not torch.equal(_logits(runner), before)
    answer = runner.reload_weights("")
    assert answer["path"] is None and runner.graphs is graphs
    assert torch.equal(_logits(runner), before)

"""Sleep mode and pausing in the engine, on CPU with the tiny random Llama (a safetensors
folder, so level 2 reads it again): what a sleep empties, what a wake-up restores (the
weights bit for bit, a zeroed pool), what each mode does to the requests in flight and
to those that arrive meanwhile, and the refusals. Every request ends with its greedy
tokens or an explicit end, and the pool is free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.util import greedy, load
from tests.server.engine.test_engine_core import run_to_end, submit, tokens_of
from tpserve.model.runner import ModelRunner
from tpserve.model.runner_config import RunnerConfig
from tpserve.model.sampling_params import SamplingParams
from tpserve.parallel.state import TPGroup
from tpserve.server.engine.config import EngineConfig
from tpserve.server.engine.engine_core import EngineCore
from tpserve.server.engine.errors import ConflictError, EngineError, InvalidRequestError
from tpserve.server.engine.pause import PAUSED, Deferred
from tpserve.server.engine.queries import run_query
from tpserve.server.engine.scheduler import SchedulerConfig

CPU = torch.device("cpu")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def prompts_and_greedy(folder):
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    model, comm = load(folder)
    return prompts, [greedy(model, comm, p, PARAMS.max_tokens) for p in prompts]


def make_core(folder, tokenizer, enabled: bool = True, **runner) -> EngineCore:
    cfg = RunnerConfig(model=folder, kv_cache_memory=24 * 2 * 2 * 16 * 1 * 16 * 4 * 2,
                       **runner)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                            block_size=16)
    r = ModelRunner(cfg, sched.limits, TPGroup(0, 1, CPU, None))
    return EngineCore(r, tokenizer, sched,
                      EngineConfig(check_integrity=True, enable_sleep_mode=enabled))


def weights(core: EngineCore) -> list[torch.Tensor]:
    return [p.detach().clone() for p in core.runner.model.parameters()]


def emptied(core: EngineCore) -> bool:
    params = list(core.runner.model.parameters())
    return (all(p.untyped_storage().nbytes() == 0 for p in params)
            and core.runner.kv_pool.buffer.untyped_storage().nbytes() == 0)


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_empties_the_weights_and_pool_and_a_wake_up_restores_them(
        folder, smollm2_tokenizer, prompts_and_greedy, level):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    before = weights(core)
    nbytes = sum(w.numel() * w.element_size() for w in before)
    first = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(first) == expected[0]
    assert core.block_manager.num_cached_free_blocks > 0

    answer = run_query(core, ("sleep", level, "abort"))
    assert answer["is_sleeping"] and answer["level"] == level
    (rank,) = answer["ranks"]
    assert rank["weights_bytes"] == nbytes
    assert rank["kv_cache_bytes"] == core.runner.kv_pool.nbytes
    assert rank["host_copy_bytes"] == (nbytes if level == 1 else 0)
    assert emptied(core)
    assert run_query(core, "is_sleeping") and run_query(core, "is_paused")
    assert core.block_manager.num_cached_free_blocks == 0  # the content is gone
    report = core.memory.report()["sleep"]
    assert report == {"state": "weights_offloaded" if level == 1 else "discard_all",
                      "level": level, "weights_asleep": True, "kv_cache_asleep": True,
                      "host_copy_bytes": nbytes if level == 1 else 0}

    later = submit(core, "b", prompts[1], PARAMS)  # held until the wake-up
    assert not core.wants_step and not core.step() and later == []
    stats = core.stats()
    assert stats["num_requests_waiting"] == 1 and stats["engine_sleep_level"] == level
    assert stats["engine_paused"] == 1.0

    woke = run_query(core, ("wake_up", None))
    assert woke["is_sleeping"] is False and woke["ranks"][0]["weights_bytes"] == nbytes
    assert not run_query(core, "is_sleeping") and not run_query(core, "is_paused")
    assert all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    assert not core.runner.kv_pool.buffer.any()  # zeroed
    assert core.memory.report()["sleep"]["state"] == "awake"
    run_to_end(core)
    assert tokens_of(later) == expected[1]
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_tags_wake_the_weights_then_the_pool(folder, smollm2_tokenizer, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    run_query(core, ("sleep", 1, "abort"))
    answer = run_query(core, ("wake_up", ("weights",)))
    assert answer["is_sleeping"] is True
    assert answer["ranks"][0]["weights_bytes"] > 0
    assert answer["ranks"][0]["kv_cache_bytes"] == 0
    assert core.runner.kv_pool.buffer.untyped_storage().nbytes() == 0
    assert run_query(core, "is_sleeping")
    out = submit(core, "a", prompts[2], PARAMS)
    assert not core.step()
    answer = run_query(core, ("wake_up", ("kv_cache",)))
    assert answer["is_sleeping"] is False
    assert answer["ranks"][0] == {**answer["ranks"][0], "weights_bytes": 0,
                                  "kv_cache_bytes": core.runner.kv_pool.nbytes}
    run_to_end(core)
    assert tokens_of(out) == expected[2]


def test_modes_abort_keep_and_wait(folder, smollm2_tokenizer, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    # abort: the requests in flight end now, finish reason abort
    outs = [submit(core, f"a{i}", p, PARAMS) for i, p in enumerate(prompts[:3])]
    for _ in range(4):
        core.step()
    run_query(core, ("sleep", 1, "abort"))
    for o in outs:
        assert o[-1].finished and o[-1].deltas[-1].finish_reason == "abort"
        assert tokens_of(o) == expected[outs.index(o)][:len(tokens_of(o))]
    assert not core.requests and core.block_manager.num_used_blocks == 0
    run_query(core, ("wake_up", None))

    # keep: preempted (the pool's content is lost), then computed again after wake-up
    outs = [submit(core, f"k{i}", p, PARAMS) for i, p in enumerate(prompts[:3])]
    for _ in range(4):
        core.step()
    preempted = core.counters["num_preemptions_total"]
    run_query(core, ("sleep", 2, "keep"))
    assert core.counters["num_preemptions_total"] > preempted
    assert not any(o and o[-1].finished for o in outs) and emptied(core)
    run_query(core, ("wake_up", None))
    run_to_end(core)
    for o, want in zip(outs, expected, strict=False):
        assert tokens_of(o) == want and o[-1].deltas[-1].finish_reason == "length"

    # wait: the sleep completes after the requests in flight end; one added meanwhile is
    # held and served after the wake-up
    outs = [submit(core, f"w{i}", p, PARAMS) for i, p in enumerate(prompts[:2])]
    core.step()
    deferred = run_query(core, ("sleep", 1, "wait"))
    assert isinstance(deferred, Deferred) and not deferred.ready()
    late = submit(core, "late", prompts[3], PARAMS)
    steps = 0
    while not deferred.ready():
        core.step()
        steps += 1
        assert steps < 500
    assert deferred.finish()["is_sleeping"] and emptied(core)
    for o, want in zip(outs, expected, strict=False):
        assert tokens_of(o) == want
    assert late == []
    run_query(core, ("wake_up", None))
    run_to_end(core)
    assert tokens_of(late) == expected[3]
    bm = core.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def test_level_0_stops_the_steps_only_and_any_wake_up_resumes(folder, smollm2_tokenizer,
                                                               prompts_and_greedy):
    """vLLM's level 0: a pause of the mode given, the caches and memory kept; the engine
    counts as sleeping while paused (a plain /pause too), and a wake-up with tag
    ``scheduling`` (or none) resumes, while a level 1 sleep waits for its memory."""
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    warm = submit(core, "warm", prompts[0], PARAMS)
    run_to_end(core)
    cached = core.block_manager.num_cached_free_blocks
    assert tokens_of(warm) == expected[0] and cached
    kept = submit(core, "kept", prompts[1], PARAMS)
    core.step()
    assert run_query(core, ("sleep", 0, "keep")) == {"is_sleeping": True, "level": 0,
                                                     "ranks": []}
    assert core.pause.state == PAUSED and run_query(core, "is_sleeping")
    assert core.block_manager.num_cached_free_blocks >= cached  # the caches stay
    assert not emptied(core) and not core.step()
    with pytest.raises(InvalidRequestError, match="unknown wake-up tag"):
        run_query(core, ("wake_up", ("weights", "steps")))
    assert run_query(core, ("wake_up", ("scheduling",))) == {"is_sleeping": False,
                                                              "ranks": []}
    assert not run_query(core, "is_sleeping")
    run_to_end(core)
    assert tokens_of(kept) == expected[1]

    run_query(core, ("pause", "abort", True))  # a plain pause: sleeping, as vLLM says
    assert run_query(core, "is_sleeping") and run_query(core, "is_paused")
    run_query(core, ("wake_up", None))  # resumes it, as vLLM's wake-up does
    assert core.pause.state == "running"

    run_query(core, ("sleep", 1, "abort"))
    assert run_query(core, ("wake_up", ("scheduling",))) == {"is_sleeping": True,
                                                              "ranks": []}
    assert emptied(core) and run_query(core, "is_sleeping")
    assert not run_query(core, ("wake_up", ("scheduling", "weights", "kv_cache")))[
        "is_sleeping"]
    late = submit(core, "late", prompts[2], PARAMS)
    run_to_end(core)
    assert tokens_of(late) == expected[2]


def test_pause_keeps_the_running_requests_blocks_and_resume_continues(
        folder, smollm2_tokenizer, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    outs = [submit(core, f"p{i}", p, PARAMS) for i, p in enumerate(prompts[:2])]
    for _ in range(3):
        core.step()
    assert run_query(core, ("pause", "keep", True)) == {"is_paused": True}
    used = core.block_manager.num_used_blocks
    assert used > 0 and core.pause.state == PAUSED
    held = submit(core, "held", prompts[2], PARAMS)
    assert not core.step() and core.block_manager.num_used_blocks == used
    with pytest.raises(InvalidRequestError, match="3 KV blocks are held by requests"):
        run_query(core, "reset_prefix_cache")
    assert run_query(core, ("pause", "abort", True)) == {"is_paused": True}  # idempotent
    run_query(core, "resume")
    run_to_end(core)
    for o, want in zip([*outs, held], expected, strict=False):
        assert tokens_of(o) == want
    assert core.block_manager.num_cached_free_blocks > 0
    assert run_query(core, "reset_prefix_cache") is True
    assert core.block_manager.num_cached_free_blocks == 0
    core.block_manager.check_integrity()
    # vLLM's reset_running_requests: the running request is preempted, then recomputed
    out = submit(core, "reset", prompts[1], PARAMS)
    core.step()
    preempted = core.counters["num_preemptions_total"]
    assert run_query(core, ("reset_prefix_cache", True, False)) is True
    assert core.counters["num_preemptions_total"] == preempted + 1
    run_to_end(core)
    assert tokens_of(out) == expected[1]

    # wait, then called off by resume: the deferred answer is an error, nothing is lost
    outs = [submit(core, "q", prompts[3], PARAMS)]
    core.step()
    deferred = run_query(core, ("pause", "wait", True))
    run_query(core, "resume")
    assert deferred.ready()
    with pytest.raises(ConflictError, match="called off"):  # HTTP 409
        deferred.finish()
    run_to_end(core)
    assert tokens_of(outs[0]) == expected[3]


def test_refusals_name_what_is_wrong(folder, smollm2_tokenizer):
    core = make_core(folder, smollm2_tokenizer)
    for query, match in ((("sleep", 3, "abort"), "level must be 0, 1 or 2"),
                         (("sleep", 1, "later"), "mode must be one of abort, wait, keep"),
                         (("pause", "soon", True), "mode must be one of"),
                         (("wake_up", ("weights", "gpu")), "unknown wake-up tag")):
        with pytest.raises(InvalidRequestError, match=match):
            run_query(core, query)
    run_query(core, ("sleep", 1, "abort"))
    assert run_query(core, ("sleep", 1, "abort"))["ranks"] == []  # already so
    with pytest.raises(InvalidRequestError, match="already sleeps at level 1"):
        run_query(core, ("sleep", 2, "abort"))
    with pytest.raises(InvalidRequestError, match="asleep: POST /wake_up resumes it"):
        run_query(core, "resume")
    run_query(core, ("wake_up", None))
    assert run_query(core, ("wake_up", None)) == {"is_sleeping": False, "ranks": []}

    off = make_core(folder, smollm2_tokenizer, enabled=False)
    for query in (("sleep", 1, "abort"), ("pause", "abort", True), "resume"):
        with pytest.raises(InvalidRequestError, match="--enable-sleep-mode"):
            run_query(off, query)


def test_level_2_is_refused_where_the_checkpoint_is_not_what_is_served(
        folder, smollm2_tokenizer):
    core = make_core(folder, smollm2_tokenizer, quantization="fp8")
    with pytest.raises(InvalidRequestError,
                       match="level 2 is not possible here: --quantization fp8 transforms"):
        run_query(core, ("sleep", 2, "abort"))
    assert not run_query(core, "is_sleeping")
    run_query(core, ("sleep", 1, "abort"))  # level 1 keeps what is served
    run_query(core, ("wake_up", None))


def _trained(folder, tmp_path, name: str, layers: int | None = None) -> str:
    """A copy of ``folder`` as a trainer would write it: every tensor moved a little (or,
    with ``layers``, a model of another depth)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    shutil.copytree(folder, out)
    gen = torch.Generator().manual_seed(7)
    for f in sorted(out.glob("*.safetensors")):
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
                   for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    if layers is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_reload_weights_serves_a_trainers_new_checkpoint(folder, smollm2_tokenizer,
                                                         prompts_and_greedy, tmp_path):
    prompts, expected = prompts_and_greedy
    new = _trained(folder, tmp_path, "step-1")
    model, comm = load(new)
    expected_new = greedy(model, comm, prompts[0], PARAMS.max_tokens)
    assert expected_new != expected[0]
    core = make_core(folder, smollm2_tokenizer)
    out = submit(core, "old", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0] and core.block_manager.num_cached_free_blocks
    answer = run_query(core, ("reload_weights", new))
    assert answer["status"] == "reloaded" and answer["path"] == new
    assert core.block_manager.num_cached_free_blocks == 0  # computed with the old weights
    out = submit(core, "new", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected_new
    # the served checkpoint is now the new one: read again, and read at a level-2 wake-up
    assert run_query(core, ("reload_weights", ""))["path"] is None
    run_query(core, ("sleep", 2, "abort"))
    run_query(core, ("wake_up", None))
    out = submit(core, "again", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected_new


def test_reload_weights_refusals_leave_the_weights_as_they_were(folder, smollm2_tokenizer,
                                                                prompts_and_greedy, tmp_path):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    before = weights(core)
    deeper = _trained(folder, tmp_path, "deeper", layers=1)
    with pytest.raises(InvalidRequestError,
                       match="not the served model's shape: num_hidden_layers 2 -> 1"):
        run_query(core, ("reload_weights", deeper))
    with pytest.raises(InvalidRequestError, match="no config.json"):
        run_query(core, ("reload_weights", str(tmp_path)))
    out = submit(core, "running", prompts[1], PARAMS)
    core.step()
    with pytest.raises(InvalidRequestError, match="requests hold .* KV blocks"):
        run_query(core, ("reload_weights", ""))
    run_to_end(core)
    assert tokens_of(out) == expected[1]
    assert all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    calibrated = make_core(folder, smollm2_tokenizer, kv_cache_dtype="fp8_e4m3",
                           calculate_kv_scales=True, load_format="dummy")  # seeded ids
    with pytest.raises(InvalidRequestError, match="KV cache scales were calibrated"):
        run_query(calibrated, ("reload_weights", ""))


def test_a_second_pause_of_mode_wait_after_a_resume_is_its_own(folder, smollm2_tokenizer,
                                                                 prompts_and_greedy):
    """pause(wait), resume, a new request, pause(wait) again: the first pause's answer is
    that it was called off (at once), the second completes after the new request has
    ended in full; is_paused holds while it waits, and a pause meanwhile joins it."""
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    a = submit(core, "a", prompts[0], PARAMS)
    core.step()
    first = run_query(core, ("pause", "wait", True))
    assert run_query(core, "is_paused")
    run_query(core, "resume")
    b = submit(core, "b", prompts[1], PARAMS)
    core.step()
    second = run_query(core, ("pause", "wait", True))
    joiner = run_query(core, ("pause", "abort", True))
    assert first.ready()
    with pytest.raises(ConflictError, match="called off"):  # HTTP 409
        first.finish()
    steps = 0
    while not second.ready():
        assert not joiner.ready()
        core.step()
        steps += 1
        assert steps < 500
    assert second.finish() == {"is_paused": True} and joiner.finish() == {"is_paused": True}
    assert tokens_of(a) == expected[0] and tokens_of(b) == expected[1]
    assert core.block_manager.num_used_blocks == 0


def test_a_sleep_of_mode_abort_while_paused_keeps_the_held_requests(
        folder, smollm2_tokenizer, prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    running = submit(core, "running", prompts[0], PARAMS)
    core.step()
    run_query(core, ("pause", "keep", True))
    held = submit(core, "held", prompts[1], PARAMS)
    run_query(core, ("sleep", 1, "abort"))
    assert running[-1].finished and running[-1].deltas[-1].finish_reason == "abort"
    assert held == [] and "held" in core.requests
    run_query(core, ("wake_up", None))
    run_to_end(core)
    assert tokens_of(held) == expected[1]


def test_a_failed_sleep_leaves_the_engine_as_it_was(folder, smollm2_tokenizer,
                                                   prompts_and_greedy, monkeypatch):
    """Level 1's host copy fails (injected: as ``cudaHostRegister`` or a full host would):
    a paused engine stays paused, a running one runs on; nothing was emptied."""
    import tpserve.model.sleep as sleep_module
    from tpserve.server.engine.control import EngineMemoryError

    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)

    def no_host_memory(*args, **kwargs):
        raise RuntimeError("out of host memory (injected)")

    monkeypatch.setattr(sleep_module, "HostCopy", no_host_memory)
    out = submit(core, "a", prompts[0], PARAMS)
    core.step()
    with pytest.raises(EngineMemoryError, match="could not copy its weights to host memory"):
        run_query(core, ("sleep", 1, "keep"))
    assert not run_query(core, "is_paused") and not emptied(core)
    run_query(core, ("pause", "keep", True))
    held = submit(core, "held", prompts[1], PARAMS)
    with pytest.raises(EngineMemoryError):
        run_query(core, ("sleep", 1, "keep"))
    assert core.pause.state == PAUSED
    assert held == []
    run_query(core, "resume")
    run_to_end(core)
    assert tokens_of(out) == expected[0] and tokens_of(held) == expected[1]


def test_a_level_2_wake_up_whose_checkpoint_is_gone_stays_asleep(
        folder, smollm2_tokenizer, prompts_and_greedy, tmp_path):
    import shutil

    prompts, expected = prompts_and_greedy
    served = tmp_path / "served"
    shutil.copytree(folder, served)
    core = make_core(str(served), smollm2_tokenizer)
    run_query(core, ("sleep", 2, "abort"))
    served.rename(tmp_path / "moved")
    with pytest.raises(EngineError, match="wake-up failed on a rank .*still asleep"):
        run_query(core, ("wake_up", None))
    assert run_query(core, "is_sleeping") and emptied(core)
    (tmp_path / "moved").rename(served)
    run_query(core, ("wake_up", None))
    out = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0]


def test_the_step_loop_answers_a_wait_after_the_outputs_and_drains_a_paused_engine_at_once(
        folder, smollm2_tokenizer, prompts_and_greedy):
    """Through the engine thread (``AsyncEngine``): a sleep of mode wait is answered after
    the request it waited for has its whole answer; a shutdown drain of a paused engine
    aborts the held request at once instead of waiting out its timeout (an hour here:
    pytest's timeout would end a drain that waited)."""
    import asyncio

    from tpserve.server.engine.step_loop import AsyncEngine

    prompts, expected = prompts_and_greedy
    engine = AsyncEngine(make_core(folder, smollm2_tokenizer), "tiny")
    engine.start()

    async def scenario() -> tuple[list, list, dict]:
        order: list[str] = []

        async def generate(rid: str, prompt: list[int]) -> list:
            outs = [o async for o in engine.generate(rid, prompt, PARAMS)]
            order.append(rid)
            return outs

        first = asyncio.create_task(generate("first", prompts[0]))
        while not engine.stats()["num_requests_running"]:
            await asyncio.sleep(0.01)
        slept = await engine.query(("sleep", 1, "wait"))
        order.append("slept")
        held = asyncio.create_task(generate("held", prompts[1]))
        while not engine.stats()["num_requests_waiting"]:
            await asyncio.sleep(0.01)
        clean = await asyncio.to_thread(engine.drain, 3600)
        assert not clean
        return await first, await held, {"order": order, "slept": slept}

    try:
        first, held, seen = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert seen["order"][:2] == ["first", "slept"] and seen["slept"]["is_sleeping"]
    assert tokens_of(first) == expected[0]
    assert held[-1].finished and held[-1].deltas[-1].finish_reason == "abort"


def test_a_failed_reload_reads_the_previous_weights_again(folder, smollm2_tokenizer,
                                                          prompts_and_greedy, tmp_path):
    """A checkpoint that fails mid-load (a tensor missing at the end; a truncated shard
    the trainer is still writing) is a 400: the previous weights are read again, the
    engine serves on, and the prefix cache is reset either way."""
    from safetensors.torch import load_file, save_file

    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    before = weights(core)
    lacking = _trained(folder, tmp_path, "lacking")
    shards = sorted(p for p in (tmp_path / "lacking").glob("*.safetensors"))
    last = load_file(shards[-1])
    last.pop(sorted(last)[-1])
    save_file(last, shards[-1], metadata={"format": "pt"})
    out = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    with pytest.raises(InvalidRequestError, match="checkpoint lacks 1 tensors.*previous "
                                                  "weights were read again"):
        run_query(core, ("reload_weights", lacking))
    assert core.block_manager.num_cached_free_blocks == 0
    assert all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    truncated = _trained(folder, tmp_path, "truncated")
    shard = sorted((tmp_path / "truncated").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(InvalidRequestError, match="reload: "):
        run_query(core, ("reload_weights", truncated))
    assert all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    out = submit(core, "b", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0]


def test_undo_takes_back_a_reload_and_a_sleep(folder, smollm2_tokenizer, prompts_and_greedy,
                                             tmp_path):
    """What data parallelism sends a replica where a reload or a sleep took effect while
    another replica's failed (``server/data_parallel.py``): the weights before the reload,
    bit for bit, and the state the sleep found (paused: its held request stays held)."""
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer)
    before = weights(core)
    with pytest.raises(InvalidRequestError, match="no reload to undo"):
        run_query(core, ("reload_weights", "", True))
    run_query(core, ("reload_weights", _trained(folder, tmp_path, "step-1")))
    assert not all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    assert run_query(core, ("reload_weights", "", True))["status"] == "reloaded"
    assert all(torch.equal(a, b) for a, b in zip(weights(core), before, strict=True))
    with pytest.raises(InvalidRequestError, match="no reload to undo"):  # undone already
        run_query(core, ("reload_weights", "", True))
    run_query(core, ("pause", "keep", True))
    held = submit(core, "held", prompts[1], PARAMS)
    run_query(core, ("sleep", 1, "abort"))
    run_query(core, ("wake_up", None, True))
    assert core.pause.state == PAUSED
    core.step()
    assert held == [] and "held" in core.requests
    run_query(core, "resume")
    run_to_end(core)
    assert tokens_of(held) == expected[1]
    run_query(core, ("sleep", 1, "abort"))  # found running: the undo resumes
    run_query(core, ("wake_up", None, True))
    assert not run_query(core, "is_paused")
    out = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0]


def test_the_undo_of_a_reload_that_woke_the_weights_puts_them_back_to_sleep(
        folder, smollm2_tokenizer, prompts_and_greedy, tmp_path):
    """A reload while asleep wakes the weights from the new checkpoint; its undo (data
    parallelism's, when another replica failed) empties them again, the engine asleep, and
    the wake-up reads the checkpoint before. With ``hold``, a reload that leaves nothing
    asleep pauses the engine instead of resuming it (``resumes`` in the answer), and its
    undo puts the weights back to sleep too."""
    prompts, expected = prompts_and_greedy
    new = _trained(folder, tmp_path, "step-1")
    core = make_core(folder, smollm2_tokenizer)
    run_query(core, ("sleep", 2, "abort"))
    answer = run_query(core, ("reload_weights", new, False, True))
    assert answer["is_sleeping"] and answer["resumes"] is False
    assert not core.runner.sleep_state.weights_asleep
    assert run_query(core, ("reload_weights", "", True))["is_sleeping"]
    assert emptied(core) and run_query(core, "is_sleeping")
    run_query(core, ("wake_up", ("kv_cache",)))
    answer = run_query(core, ("reload_weights", new, False, True))
    assert answer["resumes"] and not answer["is_sleeping"]
    assert core.pause.state == PAUSED
    held = submit(core, "held", prompts[1], PARAMS)
    core.step()
    assert held == []
    run_query(core, ("reload_weights", "", True))
    assert run_query(core, "is_sleeping") and core.runner.sleep_state.weights_asleep
    assert core.runner.kv_pool.buffer.untyped_storage().nbytes() > 0  # the KV pool awake
    run_query(core, ("wake_up", None))
    run_to_end(core)
    assert tokens_of(held) == expected[1]  # the weights before the reload


def test_weights_asleep_wake_up_from_a_new_checkpoint(folder, smollm2_tokenizer,
                                                      prompts_and_greedy, tmp_path):
    """vLLM's loop: sleep at level 2, the trainer writes a checkpoint, the weights wake up
    from it (the pool still asleep: the engine too), then the pool; and a level-2 sleep
    forgets the host tier's blocks too (its wake-up reads a checkpoint that may differ)."""
    prompts, expected = prompts_and_greedy
    new = _trained(folder, tmp_path, "step-2")
    model, comm = load(new)
    expected_new = greedy(model, comm, prompts[0], PARAMS.max_tokens)
    core = make_core(folder, smollm2_tokenizer)
    run_query(core, ("sleep", 2, "abort"))
    answer = run_query(core, ("reload_weights", new))
    assert answer["status"] == "reloaded" and answer["is_sleeping"] is True
    assert not core.runner.sleep_state.weights_asleep and core.runner.sleep_state.kv_asleep
    assert run_query(core, "is_sleeping")
    run_query(core, ("wake_up", ("kv_cache",)))
    assert not run_query(core, "is_sleeping")
    out = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected_new
    # asleep at level 1 too: the host copy is dropped, the new weights read, all awake
    run_query(core, ("sleep", 1, "abort"))
    run_query(core, ("wake_up", ("kv_cache",)))
    answer = run_query(core, ("reload_weights", folder))
    assert answer["is_sleeping"] is False and core.runner.sleep_state.report()[
        "host_copy_bytes"] == 0
    out = submit(core, "b", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0]


def test_a_dummy_served_model_reloads_a_real_checkpoint(folder, smollm2_tokenizer,
                                                       prompts_and_greedy):
    prompts, expected = prompts_and_greedy
    core = make_core(folder, smollm2_tokenizer, load_format="dummy")
    answer = run_query(core, ("reload_weights", folder))
    assert not answer["description"].startswith("dummy")
    out = submit(core, "a", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == expected[0]


def _with_kv_scales(folder, tmp_path, name: str) -> str:
    """A copy of ``folder`` with FP8 KV cache scales of its own (vLLM's names)."""
    import shutil

    from tests.model.test_fp8_kv_cache import _with_scale_tensors

    out = tmp_path / name
    shutil.copytree(folder, out)
    return _with_scale_tensors(str(out), {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0)})


def _fp8_tokens(folder, tokenizer, prompt, **runner) -> list[int]:
    core = make_core(folder, tokenizer, kv_cache_dtype="fp8_e4m3", **runner)
    out = submit(core, "fresh", prompt, PARAMS)
    run_to_end(core)
    return tokens_of(out)


def test_a_reload_reads_the_kv_scales_of_the_new_checkpoint(folder, smollm2_tokenizer,
                                                            prompts_and_greedy, tmp_path):
    """The FP8 cache's scales are the served checkpoint's after every reload and undo, 1.0
    where it has none (they stayed the last scaled checkpoint's before); the tokens are
    those of an engine started on that checkpoint."""
    prompts, _ = prompts_and_greedy
    scaled = _with_kv_scales(folder, tmp_path, "scaled")
    ones, theirs = [[1.0, 1.0], [1.0, 1.0]], [[0.5, 0.25], [2.0, 2.0]]
    core = make_core(scaled, smollm2_tokenizer, kv_cache_dtype="fp8_e4m3")
    assert core.runner.model.kv_scales().tolist() == theirs
    assert run_query(core, ("reload_weights", folder))["path"] == folder
    assert core.runner.model.kv_scales().tolist() == ones
    assert not core.runner.model.kv_scales_from_checkpoint
    out = submit(core, "plain", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == _fp8_tokens(folder, smollm2_tokenizer, prompts[0])
    run_query(core, ("reload_weights", "", True))  # the undo: the scaled one again
    assert core.runner.model.kv_scales().tolist() == theirs
    out = submit(core, "scaled", prompts[0], PARAMS)
    run_to_end(core)
    assert tokens_of(out) == _fp8_tokens(scaled, smollm2_tokenizer, prompts[0])
    # asleep: the reload wakes the weights from the plain checkpoint; its undo puts them
    # back to sleep, and they wake from the scaled one again, with its scales
    run_query(core, ("sleep", 2, "abort"))
    run_query(core, ("reload_weights", folder))
    assert core.runner.model.kv_scales().tolist() == ones
    run_query(core, ("reload_weights", "", True))
    run_query(core, ("wake_up", None))
    assert core.runner.model.kv_scales().tolist() == theirs


def test_a_checkpoint_with_kv_scales_is_refused_where_the_cache_holds_rotated_k(
        folder, smollm2_tokenizer, tmp_path):
    scaled = _with_kv_scales(folder, tmp_path, "scaled")
    rotated = make_core(folder, smollm2_tokenizer, kv_cache_dtype="fp8_e4m3",
                        kv_cache_hadamard=True)
    with pytest.raises(InvalidRequestError, match="has FP8 KV cache scales, chosen for "
                       "unrotated K, and this server rotates K.*--no-kv-cache-hadamard"):
        run_query(rotated, ("reload_weights", scaled))
    assert rotated.runner.model.kv_scales().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    plain = make_core(folder, smollm2_tokenizer, kv_cache_dtype="fp8_e4m3")
    run_query(plain, ("reload_weights", scaled))
    assert plain.runner.model.kv_scales().tolist() == [[0.5, 0.25], [2.0, 2.0]]
    # a 16-bit or float32 cache ignores the scales: the rotation refuses nothing there
    run_query(make_core(folder, smollm2_tokenizer, kv_cache_hadamard=True),
              ("reload_weights", scaled))


def test_a_level_2_wake_up_keeps_the_calibrated_kv_scales(folder, smollm2_tokenizer):
    """The wake-up reads the checkpoint again, which sets its KV scales (1.0 here); the
    scales --calculate-kv-scales chose at start-up stay."""
    core = make_core(folder, smollm2_tokenizer, kv_cache_dtype="fp8_e4m3",
                     calculate_kv_scales=True, load_format="dummy")  # seeded ids
    calibrated = core.runner.model.kv_scales()
    assert not torch.equal(calibrated, torch.ones_like(calibrated))
    run_query(core, ("sleep", 2, "abort"))
    run_query(core, ("wake_up", None))
    assert torch.equal(core.runner.model.kv_scales(), calibrated)
    assert not core.runner.model.kv_scales_from_checkpoint

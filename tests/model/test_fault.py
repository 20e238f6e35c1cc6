"""The test-only fault hook is parsed once into a frozen object; malformed specs are clear
errors."""

from __future__ import annotations

import pytest
import torch

from tpserve.model.fault import (
    FAULT_ENV,
    RELOAD,
    SAMPLE,
    SLEEP,
    START,
    FaultHook,
    FaultHooks,
    MiB,
    parse_fault,
    replica_fault_spec,
)


def test_parse_fault():
    assert parse_fault("", 0) is None
    assert parse_fault("1:5:exit", 0) is None  # another rank's
    assert parse_fault("1:5:exit", 1) == FaultHook(5, "exit")
    assert parse_fault("0:4:oom", 0) == FaultHook(4, "oom")
    assert parse_fault("0:2:leak3", 0) == FaultHook(2, "leak3", 3 * MiB)
    assert parse_fault("0:6:oom-sample", 0) == FaultHook(6, "oom-sample")
    assert parse_fault("0:4:oom,1:5:exit,0:9:oom-sample", 0) == FaultHooks(
        (FaultHook(4, "oom"), FaultHook(9, "oom-sample")))
    assert parse_fault("0:4:oom,1:5:exit", 1) == FaultHook(5, "exit")


@pytest.mark.parametrize("spec", ["0:4", "x:4:oom", "0:4:explode", "0:4:leak", "0:4:leak0",
                                  "0:-1:raise", "0:1:2:raise", "0:4:oom-forward",
                                  "0:4:oom,", "1:2:exit,0:x:oom", "0:1:start"])
def test_malformed_fault_is_a_clear_error(spec):
    with pytest.raises(ValueError, match=f"{FAULT_ENV}=.*expected RANK:STEP:KIND"):
        parse_fault(spec, 0)


def test_fault_fires_at_its_step_and_a_leak_keeps_growing():
    hook = parse_fault("0:3:raise", 0)
    hook.fire(2)
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        hook.fire(3)
    hook.fire(4)
    leak = parse_fault("0:2:leak1", 0)
    for step in range(1, 5):
        leak.fire(step)
    assert [len(b) for b in leak.kept] == [MiB] * 3


def test_each_kind_fires_at_its_own_site():
    """``oom`` acts in the forward, ``oom-sample`` only where rank 0 samples."""
    forward, sample = parse_fault("0:3:oom", 0), parse_fault("0:3:oom-sample", 0)
    sample.fire(3)  # the forward of step 3: not its site
    forward.fire(3, SAMPLE)
    with pytest.raises(torch.OutOfMemoryError, match="at sample"):
        sample.fire(3, SAMPLE)
    with pytest.raises(torch.OutOfMemoryError, match="at forward"):
        forward.fire(3)
    sample.fire(4, SAMPLE)


def test_several_faults_fire_each_at_its_step_and_site():
    hooks = parse_fault("0:2:oom,0:3:oom-sample", 0)
    hooks.fire(2, SAMPLE)
    hooks.fire(3)
    with pytest.raises(torch.OutOfMemoryError, match="at forward"):
        hooks.fire(2)
    with pytest.raises(torch.OutOfMemoryError, match="at sample"):
        hooks.fire(3, SAMPLE)


def test_a_start_fault_fires_only_when_the_runner_is_built():
    hook = parse_fault("0:0:start", 0)
    hook.fire(0)  # the forward of step 0 and rank 0's sampling: not its site
    hook.fire(0, SAMPLE)
    with pytest.raises(RuntimeError, match="injected failure at start-up"):
        hook.fire(0, START)


def test_sleep_and_reload_faults_fire_at_their_nth_event():
    """STEP counts the rank's sleeps (or reloads) from 0; a step or a start is not one."""
    hooks = parse_fault("0:1:sleep,0:0:reload", 0)
    hooks.fire(1)
    hooks.fire(0, START)
    hooks.fire_event(SLEEP)  # sleep 0
    with pytest.raises(RuntimeError, match="injected failure at reload 0 "):
        hooks.fire_event(RELOAD)
    hooks.fire_event(RELOAD)  # reload 1
    with pytest.raises(RuntimeError, match="injected failure at sleep 1 "):
        hooks.fire_event(SLEEP)
    hooks.fire_event(SLEEP)
    assert parse_fault("0:2:reload", 0) == FaultHook(2, "reload")
    both = parse_fault("0:0:reload,0:1:reload", 0)  # the first's raise hides nothing
    for n in range(2):
        with pytest.raises(RuntimeError, match=f"injected failure at reload {n} "):
            both.fire_event(RELOAD)
    both.fire_event(RELOAD)


def test_a_replica_reads_its_own_ranks_of_the_spec():
    """Ranks count over every replica (replica r's rank k is r x tp + k)."""
    spec = "0:3:oom,2:0:start,3:5:exit"
    assert replica_fault_spec(spec, 0, 2) == "0:3:oom"
    assert replica_fault_spec(spec, 1, 2) == "0:0:start,1:5:exit"
    assert replica_fault_spec(spec, 2, 2) == ""
    assert replica_fault_spec("1:0:start", 1, 1) == "0:0:start"
    with pytest.raises(ValueError, match="expected RANK:STEP:KIND"):
        replica_fault_spec("x:0:start", 0, 1)
    with pytest.raises(ValueError, match="expected RANK:STEP:KIND"):  # another replica's
        replica_fault_spec("0:1:oom,1:0:explode", 0, 1)

"""NVTX ranges: off CUDA (and without --nvtx) a no-op; with a recording push/pop pair they
name every collective at tp 2, nested and balanced, on real gloo ranks."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tpserve.parallel.comm import Communicator
from tpserve.parallel.launch import run_ranks
from tpserve.parallel.nvtx import OFF, Ranges
from tpserve.parallel.state import TPGroup


class Recorder:
    """A push/pop pair with NVTX's signature that keeps what it was given."""

    def __init__(self):
        self.events: list[tuple[str, ...]] = []
        self.depth = 0

    def push(self, name: str) -> int:
        self.events.append(("push", name))
        self.depth += 1
        return self.depth - 1

    def pop(self) -> int:
        self.events.append(("pop",))
        self.depth -= 1
        assert self.depth >= 0, "popped more ranges than were pushed"
        return self.depth

    def ranges(self) -> Ranges:
        return Ranges(self.push, self.pop)

    def names(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "push"]


def test_off_on_cpu_and_without_the_flag():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for r in (Ranges.for_device(True, cpu), Ranges.for_device(False, cpu),
              Ranges.for_device(False, cuda), OFF):
        assert not r.enabled
        assert isinstance(r.range("forward"), contextlib.nullcontext)
        with r.range("forward"):  # nothing is called: no NVTX on a CPU build
            pass


def test_a_range_is_popped_when_its_body_raises():
    rec = Recorder()
    r = rec.ranges()
    with pytest.raises(ValueError), r.range("outer"), r.range("inner"):
        raise ValueError("step failed")
    assert rec.events == [("push", "outer"), ("push", "inner"), ("pop",), ("pop",)]
    assert rec.depth == 0
    with pytest.raises(ValueError, match="both push and pop"):
        Ranges(rec.push, None)


def _collectives(group: TPGroup) -> tuple[list[tuple[str, ...]], list[float]]:
    rec = Recorder()
    comm = Communicator(group, None, rec.ranges())
    x = torch.full((4, 2), float(group.rank + 1))
    out = [comm.all_reduce(x.clone()).sum().item(),
           comm.all_gather(x, dim=-1).sum().item(),
           comm.reduce_scatter(x.clone()).sum().item(),
           comm.broadcast(x.clone()).sum().item(),
           comm.all_reduce_min(x.clone()).sum().item()]
    assert rec.depth == 0
    return rec.events, out


def test_every_collective_is_a_named_range_at_tp2():
    results = run_ranks(_collectives, 2, timeout_s=120)
    for events, _ in results:
        # gloo has no reduce-scatter: it runs an all-reduce inside its own range
        assert events == [
            ("push", "all_reduce"), ("pop",),
            ("push", "all_gather"), ("pop",),
            ("push", "all_reduce"), ("pop",),
            ("push", "broadcast"), ("pop",),
            ("push", "all_reduce_min"), ("pop",)]
    assert results[0][1] == [24.0, 24.0, 12.0, 8.0, 8.0]


def test_tp1_collectives_are_not_ranges():
    rec = Recorder()
    comm = Communicator(TPGroup(0, 1, torch.device("cpu"), None), None, rec.ranges())
    comm.all_reduce(torch.ones(2))
    comm.broadcast(torch.ones(2))
    assert rec.events == []

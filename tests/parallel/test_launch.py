"""``run_ranks``: fresh ranks forked from a fork server, each with the caller's environment
at the call, a failing rank's traceback raised, and a rank that never answers timed out."""

from __future__ import annotations

import os
import time

import pytest

from tpserve.parallel.launch import run_ranks

MARK = "TPSERVE_TEST_RANK_MARK"


def _environment_and_rank(group):
    return os.environ.get(MARK), group.rank, group.world_size, os.getpid()


def _fail_on_rank_1(group):
    if group.rank == 1:
        raise ValueError("rank 1 refuses")
    return group.rank


def _sleep_on_rank_1(group, seconds):
    if group.rank == 1:
        time.sleep(seconds)
    return group.rank


def test_ranks_see_the_callers_environment_at_each_call(monkeypatch):
    monkeypatch.delenv(MARK, raising=False)
    first = run_ranks(_environment_and_rank, 2)  # starts the fork server if none runs yet
    assert [r[:3] for r in first] == [(None, 0, 2), (None, 1, 2)]
    monkeypatch.setenv(MARK, "set after the fork server started")
    second = run_ranks(_environment_and_rank, 3)
    assert [r[:3] for r in second] == [("set after the fork server started", i, 3)
                                       for i in range(3)]
    pids = {r[3] for r in first + second} | {os.getpid()}
    assert len(pids) == 6  # every rank a fresh process, none of them the caller


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed:.*ValueError: rank 1 refuses"):
        run_ranks(_fail_on_rank_1, 2)


def test_ranks_that_do_not_finish_time_out():
    with pytest.raises(TimeoutError, match="did not finish within 1.0 s"):
        run_ranks(_sleep_on_rank_1, 2, 4.0, timeout_s=1.0)

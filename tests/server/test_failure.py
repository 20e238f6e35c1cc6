"""LateBoundFailure: failures before bind are remembered, later ones delivered."""

from __future__ import annotations

from tpserve.server.failure import LateBoundFailure


def test_failures_before_bind_are_returned_and_later_ones_delivered():
    always: list[str] = []
    delivered: list[str] = []
    failure = LateBoundFailure(always=always.append)
    failure("rank 1 died")
    failure("rank 2 died")
    assert failure.early() == ["rank 1 died", "rank 2 died"]
    assert delivered == []
    assert failure.bind(delivered.append) == ["rank 1 died", "rank 2 died"]
    failure("rank 3 died")
    assert delivered == ["rank 3 died"]
    assert always == ["rank 1 died", "rank 2 died", "rank 3 died"]


def test_bind_without_failures_returns_nothing():
    delivered: list[str] = []
    failure = LateBoundFailure()
    assert failure.bind(delivered.append) == []
    failure("gone")
    assert delivered == ["gone"] and failure.early() == []

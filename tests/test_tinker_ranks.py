"""slime.tinker.ranks: a call runs on every rank in order; a failure every rank makes alike keeps
them in step, one on some ranks only breaks the group, and a dead rank is named."""

from __future__ import annotations

import os

import pytest

from slime.tinker.errors import TinkerUserError
from slime.tinker.ranks import RankGroup, RanksBroken


class Toy:
    """A rank's model: remembers what it was asked, fails where told."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.seen: list[int] = []

    def add(self, x: int) -> tuple[int, list[int]]:
        self.seen.append(x)
        return self.rank, list(self.seen)

    def refuse(self) -> None:
        raise TinkerUserError("refused alike")

    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise MemoryError(f"rank {rank} ran out")

    def exit_on(self, rank: int) -> None:
        if self.rank == rank:
            os._exit(3)


@pytest.fixture
def group():
    g = RankGroup(3)
    yield g
    g.close()


def test_every_rank_runs_each_call_in_order(group):
    group.build("m", Toy)
    assert group.call("m", "add", 1) == [(0, [1]), (1, [1]), (2, [1])]
    assert group.call("m", "add", 2) == [(0, [1, 2]), (1, [1, 2]), (2, [1, 2])]
    group.drop("m")
    assert "m" not in group.models


def test_a_refusal_every_rank_makes_keeps_the_group(group):
    group.build("m", Toy)
    with pytest.raises(TinkerUserError, match="refused alike"):
        group.call("m", "refuse")
    assert group.broken is None and group.call("m", "add", 5)[2] == (2, [5])


def test_a_failure_on_one_rank_breaks_the_group_for_good(group):
    group.build("m", Toy)
    with pytest.raises(MemoryError, match="rank 1 ran out"):
        group.call("m", "fail_on", 1)
    with pytest.raises(RanksBroken, match="out of step after a failure: MemoryError: rank 1 ran out"):
        group.call("m", "add", 1)


def test_a_dead_rank_is_named(group):
    group.build("m", Toy)
    with pytest.raises(RanksBroken, match=r"train rank 2 exited \(exit code 3\)"):
        group.call("m", "exit_on", 2)
    assert group.broken is not None

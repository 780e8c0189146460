"""The kernel's data bookkeeping, driven as the workers and ranks would drive it."""

from taas_magic.feed.coordinator import FeedCoordinator
from taas_magic.protocol import Elements, End, Exhausted, Horizon, NextPass, Ready, Stop, Want
from taas_magic.runspec import ITERABLE, MAP, FeedPlan


def _plan(kind=MAP, length=7, units=7, ranks=2, workers=2, shuffle=False, ahead=2):
    return FeedPlan(0, "loader", kind, length, units, ranks, workers, shuffle, seed=1, ahead=ahead)


def _delivered(sends, rank):
    return [loc for s in sends if s.to.is_rank and s.to.index == rank and isinstance(s.frame, Elements) for loc in s.frame.places]


def _ended(sends, rank):
    return any(s.to.is_rank and s.to.index == rank and isinstance(s.frame, End) for s in sends)


def test_map_pass_goes_round_robin_in_equal_shares_and_drops_the_remainder():
    plan = _plan(length=7)
    assert plan.fresh_length(0) == 6  # 7 elements, 2 ranks: 3 each, one dropped
    coordinator = FeedCoordinator([plan])
    sends = coordinator.on_rank(0, Want(0, 0, 10)) + coordinator.on_rank(1, Want(0, 0, 10))
    for j in (5, 1, 0, 4, 2, 3):  # workers finish out of order
        sends += coordinator.on_worker(j % 2, Ready(0, 0, j, "seg", j * 64))
    assert _delivered(sends, 0) == [("seg", 0), ("seg", 128), ("seg", 256)]  # elements 0, 2, 4 in order
    assert _delivered(sends, 1) == [("seg", 64), ("seg", 192), ("seg", 320)]
    assert _ended(sends, 0) and _ended(sends, 1)


def test_rank_gets_nothing_beyond_its_credit():
    coordinator = FeedCoordinator([_plan()])
    sends = coordinator.on_rank(0, Want(0, 0, 1))
    for j in range(6):
        sends += coordinator.on_worker(j % 2, Ready(0, 0, j, "seg", j))
    assert _delivered(sends, 0) == [("seg", 0)]
    assert _delivered(coordinator.on_rank(0, Want(0, 0, 1)), 0) == [("seg", 2)]


def test_replay_after_units_serves_the_cache_in_a_new_order_when_shuffled():
    coordinator = FeedCoordinator([_plan(length=8, units=8, shuffle=True)])
    for j in range(8):
        coordinator.on_worker(j % 2, Ready(0, 0, j, "seg", j))
    orders = []
    for pass_no in (1, 2):
        sends = coordinator.on_rank(0, Want(0, pass_no, 10)) + coordinator.on_rank(1, Want(0, pass_no, 10))
        got = _delivered(sends, 0) + _delivered(sends, 1)
        assert sorted(offset for _, offset in got) == list(range(8))  # every cached element once
        orders.append(got)
    assert orders[0] != orders[1]
    assert coordinator.figures()[0]["replayed"] == 16


def test_workers_are_held_back_until_the_ranks_consume():
    coordinator = FeedCoordinator([_plan(length=100, units=100, ahead=2)])
    horizons = []
    for j in range(4):  # the initial horizon: ahead x ranks = 4 elements
        horizons += [s for s in coordinator.on_worker(j % 2, Ready(0, 0, j, "seg", j)) if isinstance(s.frame, Horizon)]
    assert horizons == []
    sends = coordinator.on_rank(0, Want(0, 0, 2)) + coordinator.on_rank(1, Want(0, 0, 2))
    moved = [s.frame.horizon for s in sends if isinstance(s.frame, Horizon)]
    assert moved and moved[-1] == 4 + 4  # both ranks took 2: the window moved by 4


def test_iterable_passes_end_when_every_worker_is_exhausted_and_rounds_stay_whole():
    coordinator = FeedCoordinator([_plan(kind=ITERABLE, length=None, units=100)])
    sends = coordinator.on_rank(0, Want(0, 0, 10)) + coordinator.on_rank(1, Want(0, 0, 10))
    for n in range(5):  # 5 elements: 2 whole rounds, 1 left over
        sends += coordinator.on_worker(n % 2, Ready(0, 0, None, "seg", n))
    assert len(_delivered(sends, 0)) == len(_delivered(sends, 1)) == 2
    sends = coordinator.on_worker(0, Exhausted(0, 0))
    assert not _ended(sends, 0)
    sends = coordinator.on_worker(1, Exhausted(0, 0))
    assert _ended(sends, 0) and _ended(sends, 1)  # the fifth element is dropped
    assert [s.frame for s in sends if isinstance(s.frame, NextPass)] == [NextPass(0, 1), NextPass(0, 1)]  # both workers go on


def test_iterable_stops_the_workers_at_units():
    coordinator = FeedCoordinator([_plan(kind=ITERABLE, length=None, units=4)])
    sends = []
    for n in range(4):
        sends += coordinator.on_worker(n % 2, Ready(0, 0, None, "seg", n))
    assert sorted(s.to.index for s in sends if isinstance(s.frame, Stop) and not s.to.is_rank) == [0, 1]
    assert coordinator.on_worker(0, Ready(0, 0, None, "seg", 99)) == []  # overshoot is not used
    assert coordinator.figures()[0]["extracted"] == 4

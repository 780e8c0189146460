"""taas_magic/history.py's SeriesHistory: every point up to its bound, then the first point, an evenly
thinned past and the last points exactly, in bounded size; the same indices kept however the points
arrived, so series of different lengths line up (the board's band); and a search trial's curve
(search/link.py) bounded with it."""

import random
import threading

import pytest

from taas_magic.history import SeriesHistory
from taas_magic.search.link import CURVE_POINTS, PRUNE_DENSE, TrialLink, pruner_told


def _check(history, count, recent, past):
    """What a history of points 0, 1, ..., count - 1 (each point its own index) must keep."""
    kept = list(history)
    assert history.count == count and len(history) == len(kept) <= recent + past
    assert kept == history.indices() == [history.at(index) for index in history.indices()]
    assert kept[0] == 0 and kept[-1] == count - 1  # the true first and last points
    assert kept[-min(recent, count):] == list(range(max(0, count - recent), count))  # the last ones exactly
    older = kept[:-recent] if count > recent else []
    assert len(older) <= past
    gaps = {after - before for before, after in zip(older, older[1:])}
    assert gaps <= {history.stride}  # the past: evenly spaced, from the first point
    assert [index for index in range(count) if history.kept(index)] == kept


@pytest.mark.parametrize("count", [0, 1, 7, 10, 16, 17, 100, 1000, 12_345])
def test_first_last_exact_tail_even_past_and_bounded(count):
    history = SeriesHistory(recent=10, past=6)
    for index in range(count):
        history.append(index)
    if count:
        _check(history, count, 10, 6)
    else:
        assert list(history) == [] and history.count == 0 and history.thinned(5) == []


def test_below_the_bound_every_point_is_kept():
    history = SeriesHistory(recent=100, past=100)
    history.extend(range(200))
    assert list(history) == list(range(200)) and history.stride == 1
    history.append(200)
    _check(history, 201, 100, 100)
    assert len(history) < 200 and history.stride == 2


def test_the_size_stays_bounded_for_ever():
    history = SeriesHistory(recent=50, past=40, typecode="d")
    most = 0
    for start in range(0, 200_000, 1000):
        history.extend(float(index) for index in range(start, start + 1000))
        most = max(most, len(history))
        assert history.first == 0.0 and history.last == start + 999
    assert most <= 90 and len(history._past) <= 40 and len(history._recent) == 50
    assert list(history)[-50:] == [float(index) for index in range(200_000 - 50, 200_000)]


def test_batches_keep_what_one_at_a_time_keeps():
    rng = random.Random(5)
    one, batched = SeriesHistory(recent=64, past=32), SeriesHistory(recent=64, past=32)
    total = 0
    while total < 50_000:
        size = rng.choice([1, 3, 50, 64, 65, 500, 4000])
        for index in range(total, total + size):
            one.append(index)
        batched.extend(range(total, total + size))
        total += size
        assert list(one) == list(batched) and one.stride == batched.stride
    _check(batched, total, 64, 32)


def test_a_longer_series_keeps_only_indices_the_shorter_keeps_up_to_its_count():
    """What the band relies on: ranks with more reports thin more, never at other places."""
    histories = [SeriesHistory(recent=20, past=16) for _ in range(4)]
    for history, count in zip(histories, (5, 300, 1_234, 40_000)):
        history.extend(range(count))
    for shorter, longer in zip(histories, histories[1:]):
        for index in longer.indices():
            if index < shorter.count:
                assert shorter.kept(index) and shorter.at(index) == index


def test_thinned_spreads_kept_indices_evenly_with_the_first_and_the_last():
    history = SeriesHistory(recent=1000, past=1000)
    history.extend(range(1_000_000))
    picks = history.thinned(300)
    assert picks[0] == 0 and picks[-1] == 999_999 and len(picks) <= 300
    assert picks == sorted(set(picks)) and all(history.kept(index) for index in picks)
    spacing = 999_999 / 299
    assert max(after - before for before, after in zip(picks, picks[1:])) <= spacing + history.stride
    below = history.thinned(50, below=123_457)
    assert below[0] == 0 and below[-1] == history.floor(123_456) and len(below) <= 50
    small = SeriesHistory(recent=10, past=10)
    small.extend(range(15))
    assert small.thinned(100) == list(range(15)) and small.thinned(100, below=4) == [0, 1, 2, 3]


def test_a_point_thinned_out_is_not_there():
    history = SeriesHistory(recent=4, past=4)
    history.extend(range(100))
    assert not history.kept(1) and not history.kept(100) and not history.kept(-1)
    with pytest.raises(IndexError):
        history.at(1)
    with pytest.raises(ValueError):
        SeriesHistory(recent=0)


class _Trial:
    number = 3

    def __init__(self):
        self.steps = []

    def report(self, value, step):
        self.steps.append(step)

    def should_prune(self):
        return False


def test_a_trial_curve_is_bounded_its_best_exact_and_optuna_told_a_thinned_few():
    link = TrialLink(_Trial(), "loss", threading.Lock(), prunes=True)
    count = 40 * CURVE_POINTS
    for start in range(0, count, 500):
        link.reported([(step, {"loss": 5.0 - 4.0 * (step == 12_345) + step * 1e-6}) for step in range(start, start + 500)])
    assert link.curve.count == count and len(link.curve) <= 2 * CURVE_POINTS
    assert link.curve.first == (0, 5.0) and link.curve.last == (count - 1, link.last)
    assert link.last == pytest.approx(5.0 + (count - 1) * 1e-6) and link.highest == link.last
    assert link.lowest == pytest.approx(1.0 + 12_345e-6)  # exact, though step 12,345 is thinned out of the curve
    drawn = link.drawn(300)  # the search's chart: the first and last points, evenly thinned between
    assert len(drawn) <= 300 and drawn[0] == (0, 5.0) and drawn[-1] == link.curve.last
    # Optuna (whose storage copies every value at each report) is told every value up to 2,000, then
    # every 2nd, 4th, ...: the same steps for every trial of the cell
    told = link.trial.steps
    assert told[:2 * PRUNE_DENSE] == list(range(2 * PRUNE_DENSE)) and told[-1] == count - 32  # 32,000 on: every 32nd
    assert told == [step for step in range(count) if pruner_told(step)] and len(told) < count / 6
    assert sum(map(pruner_told, range(170_000_000 // 1000))) < 12_000  # each doubling adds PRUNE_DENSE

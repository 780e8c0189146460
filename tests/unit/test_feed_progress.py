"""The extraction's progress line (feed/progress.py), over a real FeedCoordinator driven by workers' frames
as the data plane drives it, publishing into a list (the run log's ``publish`` stands in for the cell), on a
clock the test moves: one display with a ``taas-`` id, published once and then updated in place, at most
every INTERVAL unless forced; the text a person reads (counts, time, rate, waiting, replayed, done, the
cache's footprint in human units)."""

import re

import pytest

from taas_magic.feed import progress
from taas_magic.feed.coordinator import FeedCoordinator
from taas_magic.feed.progress import INTERVAL, ProgressLine
from taas_magic.output.cellstream import TAAS_DISPLAY_PREFIX
from taas_magic.output.relay import Display
from taas_magic.protocol import Ready, Want
from taas_magic.runspec import MAP, FeedPlan


class Clock:
    """time.monotonic for the progress module, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress, "time", clock)
    return clock


def _plan(feed=0, name="train_loader", length=8, units=8, ranks=2, workers=2):
    return FeedPlan(feed, name, MAP, length, units, ranks, workers, shuffle=False, seed=0, ahead=4)


def _extract(coordinator: FeedCoordinator, feed: int, js, pass_no=0) -> None:
    for j in js:
        coordinator.on_worker(j % 2, Ready(feed, pass_no, j, "seg", j * 64))


def test_the_line_counts_extracted_and_waiting_elements_with_the_rate(clock):
    coordinator = FeedCoordinator([_plan()])
    line = ProgressLine(coordinator, [].append, workers=2)
    assert line.text() == "taas data (2 workers) · train_loader: 0/8 extracted in 0.0 s (-) · 0 waiting"
    clock.now += 2.0
    _extract(coordinator, 0, range(4))
    coordinator.on_rank(0, Want(0, 0, 1))  # rank 0 takes one: three wait
    assert line.text() == "taas data (2 workers) · train_loader: 4/8 extracted in 2.0 s (2/s) · 3 waiting"


def test_a_finished_feed_says_so_and_its_time_stops_at_the_end(clock):
    coordinator = FeedCoordinator([_plan()])
    line = ProgressLine(coordinator, [].append, workers=1)
    clock.now += 4.0
    _extract(coordinator, 0, range(8))
    done = "taas data (1 worker) · train_loader: 8/8 extracted in 4.0 s (2/s) · extraction done"
    assert line.text() == done
    clock.now += 60.0  # later lines keep the time it took
    assert line.text() == done


def test_replayed_elements_and_several_feeds_are_shown_on_one_line(clock):
    coordinator = FeedCoordinator([_plan(0, "a", length=4, units=4), _plan(1, "b", length=8, units=8)])
    line = ProgressLine(coordinator, [].append, workers=2)
    _extract(coordinator, 0, range(4))
    line.text()  # the line as a's extraction ends: its time stops here
    for rank in (0, 1):
        coordinator.on_rank(rank, Want(0, 1, 10))  # pass 1 of a: replayed from the cache
    clock.now += 1.0
    text = line.text()
    assert text == ("taas data (2 workers) · a: 4/4 extracted in 0.0 s (-) · extraction done · "
                           "4 replayed from cache | b: 0/8 extracted in 1.0 s (0/s) · 0 waiting")


@pytest.mark.parametrize("usage, shown", [
    ((0, 999), "0 B in RAM, 999 B on disk"),
    ((1000, 1_500_000), "1.0 kB in RAM, 1.5 MB on disk"),
    ((2_500_000_000, 12_345), "2.5 GB in RAM, 12.3 kB on disk"),
])
def test_the_caches_footprint_is_given_in_human_units(clock, usage, shown):
    line = ProgressLine(FeedCoordinator([_plan()]), [].append, workers=2)
    assert line.text(usage).endswith(f" · cache {shown}")


def test_one_display_is_published_then_updated_in_place_at_most_every_interval(clock):
    published: list[Display] = []
    coordinator = FeedCoordinator([_plan()])
    line = ProgressLine(coordinator, published.append, workers=2)
    assert re.fullmatch(TAAS_DISPLAY_PREFIX + r"data-[0-9a-f]{8}", line.display_id)  # a live view shows it itself
    assert ProgressLine(coordinator, published.append, 2).display_id != line.display_id
    line.show()
    assert len(published) == 1 and published[0].update is False
    assert published[0].transient == {"display_id": line.display_id} and published[0].metadata == {}
    _extract(coordinator, 0, range(2))
    clock.now += INTERVAL / 2
    line.show()  # too soon: nothing
    assert len(published) == 1
    assert line.seconds_until_due(clock.now) == pytest.approx(INTERVAL / 2)
    clock.now += INTERVAL / 2
    assert line.seconds_until_due(clock.now) == 0.0
    line.show()
    assert len(published) == 2 and published[1].update is True
    assert published[1].data["text/plain"].startswith("taas data (2 workers) · train_loader: 2/8 extracted")
    line.show(force=True, usage=(4096, 0))  # the end: at once, with the cache's footprint
    assert len(published) == 3 and published[2].update is True
    assert published[2].data["text/plain"].endswith(" · cache 4.1 kB in RAM, 0 B on disk")
    assert {message.transient["display_id"] for message in published} == {line.display_id}

"""The straggler line's parts: the rule (output/straggler.py), the rank's clock of time in collectives
(output/collectives.py) and the health line's split (output/health.py). A real DDP run: tests/kernel/test_board.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from taas_magic.output import collectives
from taas_magic.output.collectives import CollectiveClock
from taas_magic.output.health import Health
from taas_magic.output.straggler import straggler


def test_the_slowest_rank_is_named_with_its_ratio_and_the_others_wait():
    found = straggler({0: 0.44, 1: 0.0})
    assert found is not None and found.rank == 1 and round(found.ratio, 2) == 1.79 and found.waited == 0.44
    assert found.line() == "rank 1 is 1.8x slower than the others; they wait 44% of each step for it"
    four = straggler({0: 0.30, 1: 0.31, 2: 0.0, 3: 0.29})
    assert four is not None and four.rank == 2 and round(four.waited, 2) == 0.30


@pytest.mark.parametrize("shares", [{0: 0.10, 1: 0.12}, {0: 0.15, 1: 0.0}, {0: 0.9}, {}, {0: 1.0, 1: 1.0},
                                    {0: 0.92, 1: 0.90}, {0: 0.97, 1: 0.95, 2: 0.96}])
def test_no_rank_is_named_below_a_quarter_slower_or_alone_or_when_all_mostly_wait(shares):
    # 0.15 vs 0: 1 / 0.85 = 1.18x, under 1.25x; 0.92 vs 0.90: 1.25x, but the others wait 2 points more, not 5
    assert straggler(shares) is None


def test_overlapping_collectives_count_once_and_one_in_flight_counts_up_to_now():
    clock = CollectiveClock()
    first = clock.begin()
    time.sleep(0.05)
    second = clock.begin()  # a second bucket while the first is in flight
    clock.end(second)
    time.sleep(0.05)
    clock.end(first)
    done = clock.seconds(time.monotonic())
    assert 0.09 <= done < 0.5
    third = clock.begin()
    time.sleep(0.03)
    assert clock.seconds(time.monotonic()) >= done + 0.03  # in flight: counted to now
    clock.end(third)


def test_a_collective_that_never_completes_is_not_in_flight_in_the_next_cell():
    clock = CollectiveClock()
    lost = clock.begin()  # an async op whose future never completes, in a kept rank's cell
    time.sleep(0.02)
    clock.new_cell()
    after = clock.seconds(time.monotonic())
    time.sleep(0.05)
    assert clock.seconds(time.monotonic()) == after  # nothing in flight any more: the clock stands still
    clock.end(lost)  # completing late, it does not end the next cell's collective
    now = clock.begin()
    time.sleep(0.02)
    clock.end(lost)
    assert clock.seconds(time.monotonic()) >= after + 0.02  # still in flight
    clock.end(now)


def test_a_timed_call_counts_to_its_return_and_an_async_one_until_its_future_completes(monkeypatch):
    clock = CollectiveClock()
    monkeypatch.setattr(collectives, "clock", clock)
    future: torch.futures.Future = torch.futures.Future()

    class Work:
        def get_future(self):
            return future

    def collective(seconds, async_op=False):
        time.sleep(seconds)
        return Work() if async_op else None

    timed = collectives.timed(collective)
    assert timed.__taas_timed__ is collective and timed.__name__ == "collective"
    timed(0.02)
    synchronous = clock.seconds(time.monotonic())
    assert synchronous >= 0.02 and not clock._inflight
    work = timed(0.0, async_op=True)
    assert clock._inflight == 1  # in flight until its future completes, on another thread
    threading.Timer(0.05, future.set_result, [None]).start()
    work.get_future().wait()
    time.sleep(0.01)
    assert not clock._inflight and clock.seconds(time.monotonic()) >= synchronous + 0.04

    def failing(async_op=False):
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError):
        collectives.timed(failing)()
    assert not clock._inflight


def _figures(at: float, collective: float, steps: int) -> dict:
    return {"at": at, "cpu": at / 2, "rss": 300 << 20, "collective": collective, "steps": steps, "reports": 0}


def test_the_health_line_splits_each_step_names_the_straggler_and_lets_it_go():
    health = Health(2)
    for second in (0, 2, 4):  # rank 1 lags: rank 0 waits 1.2 s of every 2 s
        health.saw(0, _figures(second, 0.6 * second, 10 * second))
        health.saw(1, _figures(second, 0.02 * second, 10 * second))
    line = health.line()
    first, second_line = line.splitlines()
    assert "rank 0: 300 MB CPU 50% 0.10 s/step: 40.0 ms working, 60.0 ms waiting" in first, first
    assert first.endswith("2.0 ms waiting ← straggler") and "straggler" not in first.split(" | ")[0]
    assert second_line == "taas straggler · rank 1 is 2.4x slower than the others; they wait 60% of each step for it"
    for second in (6, 8, 10):  # it keeps up
        health.saw(0, _figures(second, 2.4 + 0.02 * (second - 4), 10 * second))
        health.saw(1, _figures(second, 0.08 + 0.02 * (second - 4), 10 * second))
    assert "straggler" not in health.line()

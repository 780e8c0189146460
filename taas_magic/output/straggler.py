"""The slow rank, named: from each rank's time spent waiting in collectives, which rank the others wait for.

Runs in the kernel: on the run's own thread for the live health line (output/board.py, from each rank's health,
output/collectives.py measures it), and on the cell's thread for ``--profile``'s breakdown (from the merged trace).

With DDP (or any lockstep training), every rank's step takes as long as the slowest rank's: its wall time per step
does not show which rank is slow. The time each rank *waits* in collectives does: a fast rank reaches the gradient
all-reduce first and waits there for the slow one, which finds the others already waiting and waits little. Over a
window of the same wall time on every rank, a rank's working share is ``1 - waiting share``; the slow rank's working
share, against the median of the others', is how much slower it is (the others work as long as it does less the
time they wait for it):

    rank 1 waits 2% of the window, rank 0 waits 44%: rank 1 works 98%, rank 0 56%, so rank 1 is 1.8x slower, and
    the others wait 44% of each step for it.

A rank is named when it is ``LAG_RATIO`` (1.25x) or more slower than the median of the others, and they wait
``MIN_GAP`` (5 points of the window) or more longer than it does: two ranks that both mostly wait (92% and 90%)
differ by the clock's noise, not by one waiting for the other. Only the slowest is named; one rank alone, never.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping

LAG_RATIO = 1.25  # a rank this much slower than the median of the others is named
MIN_GAP = 0.05  # ... when the others' waiting share is at least this much more than its own


@dataclass(frozen=True)
class Straggler:
    """The slowest rank, how much slower it works than the others, and the share of their time they wait for it."""

    rank: int
    ratio: float  # its working time over the median of the others'
    waited: float  # the others' mean share of the window spent waiting in collectives, 0..1

    def line(self) -> str:
        return (f"rank {self.rank} is {self.ratio:.1f}x slower than the others; "
                f"they wait {100 * self.waited:.0f}% of each step for it")


def straggler(waiting: Mapping[int, float]) -> Straggler | None:
    """The rank the others wait for, from each rank's share (0..1) of one window spent waiting in collectives;
    None when no rank is ``LAG_RATIO`` slower than the median of the others by ``MIN_GAP`` (or there is one rank)."""
    if len(waiting) < 2:
        return None
    working = {rank: max(0.0, 1.0 - min(share, 1.0)) for rank, share in waiting.items()}
    slowest = max(working, key=lambda rank: (working[rank], -rank))
    others = [work for rank, work in working.items() if rank != slowest]
    median = statistics.median(others)
    if median <= 0:
        return None  # every other rank waited the whole window: nothing says who they waited for
    ratio = working[slowest] / median
    if ratio < LAG_RATIO or working[slowest] - median < MIN_GAP:
        return None
    return Straggler(slowest, ratio, statistics.fmean(waiting[rank] for rank in working if rank != slowest))

"""A series kept in bounded memory: every point up to a bound, then an evenly thinned past and
the last points exactly.

Runs in the kernel, on a run's own thread (kernel/runs/background.py), where output/board.py and
search/link.py append to it as reports arrive; pure data, no I/O.

The kernel keeps something per ``taas.report`` for as long as a run lasts: the live chart's
series and ``taas.metrics()`` (output/board.py), a search trial's curve (search/link.py). A run
reporting every step for two days must hold no more than one reporting for an hour, so each
of them is a :class:`SeriesHistory`. It numbers the points appended 0, 1, 2, ... (a point's
*index*; ``count`` of them so far) and keeps:

- the last ``recent`` points exactly: every index from ``count - recent`` on;
- of the points before those, the *past*: indices 0, ``stride``, 2·``stride``, ... The stride
  starts at 1 and doubles whenever the past would hold more than ``past`` points (every point,
  then every 2nd, every 4th, ...), so the past stays evenly spaced and its first point is always
  the series' first.

It holds at most ``recent + past`` points whatever ``count`` reaches. The stride depends on
``count`` alone (the smallest power of two that keeps the past within ``past`` points), however
the points arrived (one at a time or in batches), so of two histories with the same bounds, the
one given more points keeps, below the other's count, only indices the other keeps too: the
board aligns the ranks' series by index that way (the lowest and highest rank at each point).

With ``typecode`` (``"d"``) the points are kept in an :class:`array.array` (8 bytes a number),
else in a list (any object).
"""

from __future__ import annotations

import itertools
from array import array
from typing import Any, Generic, Iterable, Iterator, TypeVar

RECENT = 10_000  # the last points, kept exactly
PAST = 10_000  # at most this many points before them, evenly thinned (between half and all of it once full)

T = TypeVar("T")


class SeriesHistory(Generic[T]):
    """The points of one series in bounded memory (see the module docstring)."""

    __slots__ = ("recent", "past", "_past", "_recent", "_stride", "_moved")

    def __init__(self, recent: int = RECENT, past: int = PAST, typecode: str | None = None):
        if recent < 1 or past < 1:
            raise ValueError("a history keeps at least one recent and one past point")
        self.recent, self.past = recent, past
        self._past: Any = array(typecode) if typecode else []  # index j * _stride at j
        self._recent: Any = array(typecode) if typecode else []  # index _moved + j at j
        self._stride = 1
        self._moved = 0  # points that left the recent part (those at multiples of the stride are in the past)

    # -- adding ---------------------------------------------------------------------------------
    def append(self, point: T) -> None:
        self._recent.append(point)
        if len(self._recent) > self.recent:
            self._spill()

    def extend(self, points: Iterable[T]) -> None:
        """Points in order, as many at once as arrived (a rank's batch): the same as appending each."""
        self._recent.extend(points)
        if len(self._recent) > self.recent:
            self._spill()

    def _spill(self) -> None:
        """The oldest recent points into the past (those at multiples of the stride), thinned by
        halving while it holds more than ``past``."""
        excess = len(self._recent) - self.recent
        offset = -self._moved % self._stride  # the first of them whose index is a multiple of the stride
        self._past.extend(self._recent[offset:excess:self._stride])
        if isinstance(self._recent, list):
            del self._recent[:excess]
        else:
            self._recent = self._recent[excess:]  # an array copies its tail faster than it deletes its head
        self._moved += excess
        while len(self._past) > self.past:
            self._past = self._past[::2]  # indices 0, 2·stride, 4·stride, ...: the first stays
            self._stride *= 2

    # -- reading --------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Points appended so far (the kept ones and the thinned out)."""
        return self._moved + len(self._recent)

    @property
    def stride(self) -> int:
        """The spacing of the past's indices."""
        return self._stride

    def __len__(self) -> int:
        """Points kept."""
        return len(self._past) + len(self._recent)

    def __iter__(self) -> Iterator[T]:
        """The kept points, in order: the thinned past, then the last ``recent`` exactly."""
        return itertools.chain(self._past, self._recent)

    def indices(self) -> list[int]:
        """The kept points' indices, in order."""
        return [*range(0, self._moved, self._stride), *range(self._moved, self.count)]

    def kept(self, index: int) -> bool:
        return 0 <= index < self.count and (index >= self._moved or index % self._stride == 0)

    def at(self, index: int) -> T:
        """The point of ``index``; IndexError when it was never appended or was thinned out."""
        if not self.kept(index):
            raise IndexError(f"point {index} of {self.count} is not kept")
        if index >= self._moved:
            return self._recent[index - self._moved]
        return self._past[index // self._stride]

    @property
    def first(self) -> T:
        return self.at(0)

    @property
    def last(self) -> T:
        return self.at(self.count - 1)

    def floor(self, index: int) -> int:
        """The greatest kept index at or below ``index`` (0 <= index < count)."""
        return index if index >= self._moved else index - index % self._stride

    def thinned(self, most: int, below: int | None = None) -> list[int]:
        """At most ``most`` (>= 2) kept indices below ``below`` (default: all), evenly spread over
        that range: every kept one if there are no more, else the kept index at or before each of
        ``most`` evenly spaced places. The first (0) and the last kept below ``below`` are among them."""
        end = self.count if below is None else min(below, self.count)
        if end <= 0:
            return []
        past = min(len(self._past), -(-min(end, self._moved) // self._stride))
        if past + max(0, end - self._moved) <= most:
            return [index for index in self.indices() if index < end]
        picks: list[int] = []
        for place in range(most):
            index = self.floor((end - 1) * place // (most - 1))
            if not picks or index != picks[-1]:
                picks.append(index)
        return picks

    def __repr__(self) -> str:
        return f"SeriesHistory(count={self.count}, kept={len(self)}, stride={self._stride})"

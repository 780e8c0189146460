"""The health line: each rank's figures, its time per step split into working and waiting, and the rank the others
wait for.

Runs in the kernel, on the run's own thread (output/board.py hands it each rank's batches and publishes the line).

About every 2 s each rank sends its health (output/reports.py): resident memory, CPU time, on CUDA the GPU's memory
and use, its reports and optimizer steps so far, and its seconds in collectives so far (output/collectives.py). The
line shows, for each rank, its reports per second, memory, CPU use, GPU, and over the last ``WINDOW`` health figures
(about 4 s) its time per step split into working and waiting in collectives (``0.21 s/step: 0.12 s working, 0.09 s
waiting``; without steps, the share of its time spent waiting). When one rank is ``LAG_RATIO`` slower than the
others (output/straggler.py) it is marked, and a second line names it: ``rank 1 is 1.8x slower than the others; they
wait 44% of each step for it``. The window is short, so the line names a rank within about 6 s of it starting to lag
and stops naming it as soon as it stops.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

from taas_magic.output.straggler import Straggler, straggler

BATCHES = 8  # each rank's last report batches, for its reports per second (about 2 s of them)
WINDOW = 3  # health figures (2 s apart) the split and the straggler are measured over: about 4 s


@dataclass
class _RankHealth:
    # (when sent, by the rank's clock; reports) of the last batches
    batches: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=BATCHES))
    figures: collections.deque[dict] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))


class Health:
    """Every rank's recent figures; the line they make."""

    def __init__(self, ranks: int):
        self.ranks = [_RankHealth() for _ in range(ranks)]

    def batch(self, rank: int, at: float, reports: int) -> None:
        self.ranks[rank].batches.append((at, reports))

    def saw(self, rank: int, figures: dict) -> None:
        self.ranks[rank].figures.append(figures)

    def any(self) -> bool:
        return any(record.figures for record in self.ranks)

    def last(self) -> dict[int, dict]:
        """Each rank's last figures, for the ranks that sent any."""
        return {rank: record.figures[-1] for rank, record in enumerate(self.ranks) if record.figures}

    def waiting(self, latest: bool = False) -> dict[int, float]:
        """Each rank's share (0..1) of its window spent in collectives (``latest``: its last 2 s only), for the ranks
        that measured one."""
        shares = {}
        for rank, record in enumerate(self.ranks):
            figures = list(record.figures)[-2:] if latest else record.figures
            if len(figures) >= 2 and "collective" in figures[0] and "collective" in figures[-1]:
                seconds = figures[-1]["at"] - figures[0]["at"]
                if seconds > 0:
                    shares[rank] = min(1.0, max(0.0, (figures[-1]["collective"] - figures[0]["collective"]) / seconds))
        return shares

    def straggler(self) -> Straggler | None:
        shares = self.waiting()
        return straggler(shares) if len(shares) == len(self.ranks) else None

    def line(self) -> str:
        slow = self.straggler()
        shares = self.waiting()
        parts = []
        for rank, record in enumerate(self.ranks):
            words = [f"rank {rank}:"]
            interval = _interval(record.batches)
            if interval is not None:
                words.append(f"{1 / interval:,.0f} reports/s" if interval > 0 else "reports")
            if record.figures:
                words += _figures(record.figures[-2] if len(record.figures) > 1 else record.figures[-1],
                                  record.figures[-1])
            if rank in shares:
                words.append(_split(record.figures, shares[rank]))
            if slow is not None and slow.rank == rank:
                words.append("← straggler")
            parts.append(" ".join(words))
        text = "taas health · " + " | ".join(parts)
        return text + (f"\ntaas straggler · {slow.line()}" if slow is not None else "")


def _figures(before: dict, now: dict) -> list[str]:
    """Memory, CPU use over the last 2 s, and the GPU's."""
    words = []
    if "rss" in now:
        words.append(_size(now["rss"]))
    seconds = now["at"] - before["at"]
    if seconds > 0:
        words.append(f"CPU {100 * (now['cpu'] - before['cpu']) / seconds:.0f}%")
    if "gpu_memory" in now:
        words.append(f"GPU {_size(now['gpu_memory'])}")
    if "gpu_use" in now:
        words.append(f"{now['gpu_use']}% busy")
    return words


def _split(figures: Sequence[dict], waiting: float) -> str:
    """The rank's time per step over its window, working and waiting in collectives; or its share waiting."""
    first, last = figures[0], figures[-1]
    steps = last.get("steps", 0) - first.get("steps", 0) or last.get("reports", 0) - first.get("reports", 0)
    if steps <= 0:
        return f"waiting {100 * waiting:.0f}%"
    per_step = (last["at"] - first["at"]) / steps
    return (f"{_seconds(per_step)}/step: {_seconds(per_step * (1 - waiting))} working, "
            f"{_seconds(per_step * waiting)} waiting")


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.1 else f"{1000 * value:.1f} ms"


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GB" if count >= 2**30 else f"{count / 2**20:.0f} MB"


def _interval(batches: Sequence[tuple[float, int]]) -> float | None:
    """A rank's mean time between reports over its last batches (about 2 s); None before two batches."""
    recent = list(batches)
    count = sum(reports for _, reports in recent[1:])
    if len(recent) < 2 or not count:
        return None
    return (recent[-1][0] - recent[0][0]) / count

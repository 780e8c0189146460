"""The hang line: while a rank waits in one collective for long, the cell says where every rank is.

Runs in the kernel, on the run's own thread (kernel/supervision/supervisor.py feeds it each rank's health and
asks it, as it steps, whether a line is due).

A cell whose ranks took different branches (rank 0 resumed from a checkpoint, rank 1 started from scratch)
waits forever in collectives that do not match; one whose rank 0 prepares something for minutes keeps the
others in a barrier. Without this, nothing in the cell says so until ``--timeout`` or an interrupt. Each
rank's health (output/reports.py, about every 2 s) carries how long its cell has waited in one call into
``torch.distributed`` (autopsy/waiting.py). Once one rank has waited ``seconds`` (``--hang``, 30 by default),
the supervisor takes every rank's stacks (as the autopsy does: a signal, answered from C) and the cell shows
one line, the autopsy's summary, and again at most once a minute while it lasts; it stops nothing:

    taas: ranks disagree for 30 s: rank 0 waits in broadcast (line 41); rank 1 waits in all_reduce (line 57)
    taas: ranks disagree for 30 s: rank 0 is at line 3 in time.sleep; rank 1 waits in barrier (line 5)
    taas: no rank has moved for 30 s: ranks 0, 1 wait in all_reduce (line 14)

A rank that finished its cell is named as such; where the ranks disagree and some run on a host that does not
see the notebook's repository (writes/away.py), the line says so: what rank 0 wrote is not there, the commonest
reason their branches part (a resume from a checkpoint rank 0 saved). A rank whose health stopped coming (its GIL held by C code)
is taken as still waiting, as its last figure plus the time since. Nothing is said while a rank is at a pdb
prompt (the others are held there on purpose).
"""

from __future__ import annotations

import time
from typing import Mapping

from taas_magic.autopsy.stacks import Sources, parse, position, summary

REPEAT_SECONDS = 60.0  # the line again at most this often while the wait lasts


class HangWatch:
    """Each rank's last word on its wait, and when the line is due."""

    def __init__(self, seconds: float, sources: Sources, cell: str):
        self.seconds, self.sources, self.cell = seconds, sources, cell
        self.waits: dict[int, tuple[float, float]] = {}  # rank -> (seconds waited, when the kernel heard it)
        self.away: set[int] = set()  # ranks on hosts that do not see the notebook's repository
        self.said_at: float | None = None
        self.held_at = float("-inf")  # the last moment a rank was at a pdb prompt: waits count from then

    def saw(self, rank: int, health: Mapping | None) -> None:
        """A rank's health figures (output/reports.py), perhaps with its wait."""
        if health is not None:
            self.waits[rank] = (float(health.get("waiting", 0.0)), time.monotonic())
            if health.get("away"):
                self.away.add(rank)

    def forget(self) -> None:
        """A new attempt's ranks (``--restarts``): the old ones' waits are theirs no more."""
        self.waits.clear()
        self.away.clear()

    def due(self, now: float, held: bool = False) -> float | None:
        """The longest wait now, when it is ``seconds`` or more and no line was said in the last minute; ``held``: a
        rank is at a pdb prompt now (the others wait on purpose: nothing is due, and waits count from its end)."""
        if held:
            self.held_at = now
            return None
        waited = max((seconds + now - heard for seconds, heard in self.waits.values() if seconds > 0), default=0.0)
        waited = min(waited, now - self.held_at)
        if waited < self.seconds or (self.said_at is not None and now - self.said_at < REPEAT_SECONDS):
            return None
        self.said_at = now
        return waited

    def line(self, dumps: Mapping[int, str], running: tuple[int, ...], ranks: int, waited: float) -> str:
        """Where every rank is (``dumps``: the running ranks' stacks), as one line of the cell."""
        positions = {rank: position(parse(dumps.get(rank, "")), self.sources, self.cell) for rank in running}
        where = summary(positions)
        finished = [rank for rank in range(ranks) if rank not in running]
        if finished:
            who = f"rank {finished[0]}" if len(finished) == 1 else "ranks " + ", ".join(map(str, finished))
            where += f"; {who} finished the cell"
        agree = not finished and len(set(positions.values())) == 1
        line = f"taas: {'no rank has moved' if agree else 'ranks disagree'} for {waited:.0f} s: {where}"
        if self.away and not agree:
            away = sorted(self.away)
            who = f"rank {away[0]} runs" if len(away) == 1 else "ranks " + ", ".join(map(str, away)) + " run"
            line += f" ({who} on a host that does not see the repository: what rank 0 wrote is not there)"
        return line

"""The rank's half of ``--profile [N]``: one bounded window of the cell recorded by ``torch.profiler``, sent to the kernel.

Runs in each rank: :func:`begin` and :func:`end` on the cell's thread (rank/main.py, around the cell); :func:`mark`
on whichever thread steps (the optimizer's post-step hook, ``taas.report``), in practice the cell's.

The window. The profiler (CPU, and CUDA where the rank has a GPU) records from the cell's first line. A *step mark*
ends a step: ``optimizer.step`` (as rank/steps.py counts them: the outermost step of the cell's first optimizer) or
``taas.report``, whichever marks first in the cell (a loop that does both counts each step once). Each mark calls
the profiler's ``step()``, so the trace holds ``ProfilerStep#k`` spans (``#0``: the cell's start to the first
mark). After ``1 + N`` marks the window is whole and the profiler stops: what follows costs nothing. The trace
kept is steps 1..N (the first step, which pays for lazy start-up, is left out); a cell with fewer marks is kept
whole, from its first line to its last.

The end. Whatever happened (a raise, an interrupt), :func:`end` stops the profiler, so a kept rank's next cell
starts clean; a cell that finished also sends its trace (:class:`ProfileTrace`: Kineto's Chrome
JSON, gzipped, with ``distributedInfo.rank`` set) and its clock's offset from the kernel's: ``CLOCK_PROBES``
exchanges of :class:`ClockAsk` / :class:`ClockTime`, the one with the shortest round trip kept
(offset = kernel's time - the midpoint of the rank's send and receipt, exact to half that round trip).
The kernel's half is merge.py and breakdown.py.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from taas_magic.profiling.bound import MAX_BYTES, fit
from taas_magic.profiling.breakdown import RankTime, rank_time
from taas_magic.protocol import ToKernel, ToPeer

CLOCK_PROBES = 5
CLOCK_WAIT = 10.0  # seconds for the kernel's answer to one probe; then the offset is unknown (a bound of -1)
FIRST_STEP = "ProfilerStep#1"  # the window's start when the cell marked enough steps


@dataclass(frozen=True)
class ClockAsk(ToKernel, kind="clock-ask"):
    """A rank asks the kernel's wall clock (``--profile``: the traces' clocks aligned)."""


@dataclass(frozen=True)
class ClockTime(ToPeer, kind="clock-time"):
    """The kernel's ``time.time_ns()`` as it read a :class:`ClockAsk`."""

    ns: int


@dataclass(frozen=True)
class ProfileTrace(ToKernel, kind="profile-trace"):
    """A rank's trace of its window: Kineto's Chrome JSON, gzipped; its clock against the kernel's."""

    data: bytes
    host: str
    offset_ns: int  # add to this rank's times to read them on the kernel's clock
    bound_ns: int  # how far off that offset can be: half the probe's round trip
    steps: int  # step marks the cell made
    whole: bool  # the whole cell was kept (fewer than 1 + N marks)
    time: RankTime  # the window split (breakdown.py), from every event, before any was dropped
    dropped: int  # events dropped to fit this rank's share of the file (bound.py)


Ask = Callable[[ToKernel, type], Any]  # sends a frame; the kernel's answer of that type, None after CLOCK_WAIT s


class Window:
    """One cell's profiler and its step marks (module docstring)."""

    def __init__(self, steps: int, cuda: bool):
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        # a schedule that always records: only so that step() writes the ProfilerStep#k spans
        self.profiler = profile(activities=activities, schedule=lambda step: ProfilerAction.RECORD)
        self.steps, self.marks, self.by = steps, 0, ""
        with _quiet_stderr():
            self.profiler.start()
        self.recording = True

    def mark(self, by: str) -> None:
        """A step ended (``by`` names what marks steps in this cell; the other is ignored from then on)."""
        if not self.recording or self.by not in ("", by):
            return
        self.by = by
        self.marks += 1
        self.profiler.step()
        if self.marks >= 1 + self.steps:  # the window is whole
            self.stop()

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            with _quiet_stderr():
                self.profiler.stop()

    def trace(self, rank: int, world: int) -> tuple[bytes, bool, RankTime, int]:
        """The window's Chrome JSON, gzipped and held to this rank's share of the file (bound.py); whether it is the
        whole cell; its time split from every event; how many events went."""
        fd, path = tempfile.mkstemp(prefix="taas-profile-", suffix=".json")  # owner-only (mkstemp)
        os.close(fd)
        try:
            self.profiler.export_chrome_trace(path)
            with open(path, encoding="utf-8") as file:
                trace = json.load(file)
        finally:
            os.unlink(path)
        whole = self.marks < 1 + self.steps
        events = trace.get("traceEvents", [])
        if not whole:
            events = _from_first_step(events)
        time_split = rank_time(rank, events)
        trace["traceEvents"], dropped = fit(events, MAX_BYTES // max(1, world))
        info = trace.setdefault("distributedInfo", {})
        info.setdefault("rank", rank)
        info.setdefault("world_size", world)
        return gzip.compress(json.dumps(trace).encode(), compresslevel=3), whole, time_split, dropped

    def send(self, send: Callable[[ToKernel], None], ask: Ask, rank: int, world: int) -> None:
        """The trace and this rank's clock against the kernel's, to the kernel."""
        data, whole, time_split, dropped = self.trace(rank, world)
        offset, bound = clock_offset(ask)
        send(ProfileTrace(data, socket.gethostname(), offset, bound, self.marks, whole, time_split, dropped))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto's C++ says ``profiler_start`` and ``profiler_stop`` on fd 2 whatever its log level: not in the cell.
    IMPORTANT: only around those two calls (a millisecond); whatever else writes to fd 2 then is lost with them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _from_first_step(events: list[dict]) -> list[dict]:
    """The events of steps 1..N: metadata, and what starts at or after ``ProfilerStep#1``."""
    start = min((event["ts"] for event in events if event.get("name") == FIRST_STEP), default=None)
    if start is None:
        return events
    return [event for event in events if event.get("ph") == "M" or float(event.get("ts", start)) >= start]


_window: Window | None = None


def begin(steps: int, cuda: bool) -> None:
    """The cell starts: record its window (``steps``: N, from ``--profile [N]``)."""
    global _window
    _window = Window(steps, cuda)


def mark(by: str) -> None:
    """A step mark (``"optimizer"``: rank/steps.py's listener for the rank's life; ``"report"``); nothing when no
    window records."""
    if _window is not None:
        _window.mark(by)


def end() -> Window | None:
    """The cell ended, however: the profiler stopped; the window, to send (:meth:`Window.send`)."""
    global _window
    window, _window = _window, None
    if window is not None:
        window.stop()
    return window


def clock_offset(ask: Ask) -> tuple[int, int]:
    """The kernel's clock minus this rank's, and half the round trip of the probe that measured it; (0, -1) when
    the kernel did not answer within ``CLOCK_WAIT`` (a kept rank is never held after its cell by it)."""
    best: tuple[int, int] | None = None
    for _ in range(CLOCK_PROBES):
        sent = time.time_ns()
        answer = ask(ClockAsk(), ClockTime)
        received = time.time_ns()
        if answer is None:
            return best or (0, -1)
        half = (received - sent) // 2
        if best is None or half < best[1]:
            best = (answer.ns - (sent + half), half)
    assert best is not None
    return best

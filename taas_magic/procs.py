"""Stopping process groups: the INT -> TERM -> KILL ladder, written once.

Every rank leads its own process group (``start_new_session=True``), so a signal to
the group reaches what the cell started too. SIGINT lets the cell's ``finally``
blocks run; SIGTERM and then SIGKILL follow on one shared deadline, so stopping N
ranks takes no longer than stopping one. The report says which step ended the run,
for the tests to observe (as jupyter_client's ``_ShutdownStatus`` does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Sequence

# (signal, seconds to wait after sending it). The whole ladder stays under 5 s.
LADDER: tuple[tuple[signal.Signals, float], ...] = (
    (signal.SIGINT, 1.5),
    (signal.SIGTERM, 1.0),
    (signal.SIGKILL, 2.0),
)


@dataclass
class StopReport:
    signals: list[str] = field(default_factory=list)
    still_running: list[int] = field(default_factory=list)


def signal_group(pid: int, sig: int) -> None:
    """Signal a process group, ignoring one that is already gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_leftovers(proc: subprocess.Popen) -> None:
    """After a group leader exited: kill what it left running in its group."""
    signal_group(proc.pid, signal.SIGKILL)


def reap(proc: subprocess.Popen) -> None:
    """After it was stopped: close the pipes we hold to it and wait for its exit status."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
    proc.wait()


def stop_groups(procs: Sequence[subprocess.Popen], ladder=LADDER) -> StopReport:
    """Stop every process group in ``procs``; return what it took."""
    report = StopReport()
    for sig, grace in ladder:
        running = [proc for proc in procs if proc.poll() is None]
        if not running:
            break
        report.signals.append(sig.name)
        for proc in running:
            signal_group(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(proc.poll() is None for proc in running):
            time.sleep(0.01)
    for proc in procs:
        if proc.poll() is None:
            report.still_running.append(proc.pid)
        kill_leftovers(proc)
    return report

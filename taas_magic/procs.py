"""Stopping process groups: the INT -> TERM -> KILL ladder, written once; and the cores a host's ranks
share (:func:`omp_threads`, for every launcher and the exported job).

Runs in the kernel (a run's own thread stops its ranks and data workers; the pool stops its spares),
in a Ray host agent or Slurm task (its host's ranks), and in the spare factory (its forks' exits,
:func:`exit_fd`).

Every rank leads its own process group (``start_new_session=True``), so a signal to
the group reaches what the cell started too. SIGINT lets the cell's ``finally``
blocks run; SIGTERM and then SIGKILL follow on one shared deadline, so stopping N
ranks takes no longer than stopping one. The report says which step ended the run,
for the tests to observe (as jupyter_client's ``_ShutdownStatus`` does).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import IO, Collection, Protocol, Sequence

# (signal, seconds to wait after sending it). The whole ladder stays under 5 s.
LADDER: tuple[tuple[signal.Signals, float], ...] = (
    (signal.SIGINT, 1.5),
    (signal.SIGTERM, 1.0),
    (signal.SIGKILL, 2.0),
)

# Between attempts of --restarts: no SIGINT, whose handlers (the cell's ``finally``) a restart
# does not wait for, as torchrun's agent sends SIGTERM. A rank's SIGTERM kills its group at once.
RESTART_LADDER: tuple[tuple[signal.Signals, float], ...] = (
    (signal.SIGTERM, 1.0),
    (signal.SIGKILL, 2.0),
)


class Process(Protocol):
    """What stopping and reaping need of a process: a ``subprocess.Popen``, or a spare the factory
    forked (launch/local/sparefactory.py), which is not the kernel's child."""

    @property
    def pid(self) -> int: ...

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class StopReport:
    signals: list[str] = field(default_factory=list)
    still_running: list[int] = field(default_factory=list)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (perhaps another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_fd(pid: int) -> int | None:
    """A file descriptor that becomes readable when ``pid`` exits (Linux 5.3+; a child or not,
    reaped or not), so whoever watches it wakes the moment it ends instead of at its next poll;
    None on an older kernel or another system: exits are polled there."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def signal_group(pid: int, sig: int) -> None:
    """Signal a process group, ignoring one that is already gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_leftovers(proc: Process) -> None:
    """After a group leader exited: kill what it left running in its group."""
    signal_group(proc.pid, signal.SIGKILL)


def reap(proc: Process) -> None:
    """After it was stopped: close the pipes we hold to it and wait for its exit status."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
    proc.wait()


def stop_groups(procs: Sequence[Process], ladder: Sequence[tuple[signal.Signals, float]] = LADDER,
                interrupted: Collection[int] = ()) -> StopReport:
    """Stop every process group in ``procs``; return what it took. ``interrupted``: the pids already sent their SIGINT
    (an interrupt before the stop): the ladder's SIGINT skips them but its grace still runs, so a cell's ``finally``
    is interrupted once, and has its time."""
    report = StopReport()
    for sig, grace in ladder:
        running = [proc for proc in procs if proc.poll() is None]
        if not running:
            break
        report.signals.append(sig.name)
        for proc in running:
            if not (sig == signal.SIGINT and proc.pid in interrupted):
                signal_group(proc.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(proc.poll() is None for proc in running):
            time.sleep(0.01)
    for proc in procs:
        if proc.poll() is None:
            report.still_running.append(proc.pid)
        kill_leftovers(proc)
    return report


OWNER_VARIABLE = "TAAS_OWNER"  # in every rank's and data worker's environment; their children inherit it


def kill_tagged(prefix: str) -> list[int]:
    """SIGKILL every process of this user whose environment says ``TAAS_OWNER=<prefix>...``.

    What a rank or a data worker started and that left its session or process group
    (``start_new_session=True``, ``setsid``, a double fork) is beyond the group's signals, but
    it still carries the environment it was started with: /proc says whose it is. A process
    that cleared its environment escapes this; the rank's own sweep (rank/startup.py) covers
    it while the rank lives. Returns the pids killed.
    """
    needle = f"{OWNER_VARIABLE}={prefix}".encode()
    me, uid = os.getpid(), os.getuid()
    killed: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return killed  # not Linux: the process groups are all we have
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if any(variable.startswith(needle) for variable in variables):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    return killed


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def omp_threads(local_world_size: int) -> int:
    """``OMP_NUM_THREADS`` for each of ``local_world_size`` ranks of this host: its cores shared among them."""
    return max(1, cores() // max(1, local_world_size))

"""A rank never outlives the kernel that started it, nor leaves its children behind.

Runs in each rank, spare and data worker (rank/startup.py): the lifeline's reader on a daemon
thread, the watchdog as a forked process; its :func:`prctl` also in the spare factory and in the
allocation keeper's ``salloc`` before it starts.

Three independent guards, as ipykernel's parent poller and torch's spawn do, and one more:

- the lifeline: the kernel holds the write end of the rank's stdin pipe for the whole
  run. A daemon thread blocks reading it; end-of-file means the kernel is gone (or
  dropped the run), and the thread kills the rank's whole process group, so commands
  the cell started (``!sleep 100``) die too. The pipe is moved off fd 0 first, so the
  cell and its subprocesses read /dev/null, as in a script.
- the parent-death signal: ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, and a SIGTERM handler
  that kills the group; it covers a lifeline thread that cannot run.
- the watchdog: both guards above are Python, so a cell stuck in C code that holds the
  GIL (a collective whose peer is gone, a C extension) runs neither, and the rank would
  outlive its kernel. A tiny forked process, started first thing, waits in ``poll()`` for
  the lifeline pipe to hang up (it never reads it, so the handshake still reaches the
  rank) and then SIGKILLs the rank's descendants (the rank is their subreaper, so those
  that left its session are among them) and the rank's whole process group, itself included.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from typing import IO

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15
WATCHDOG_NAME = b"taas-watchdog"


def read_first_line(fd: int = 0) -> str:
    """Read one line from fd without buffering past it (what follows stays in the pipe)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise SystemExit("taas rank: the kernel closed the lifeline before the handshake")
        data += chunk
    return data.decode("ascii").strip()


def kill_own_group(*_: object) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _watch(fd: int) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
    kill_own_group()


def hold_lifeline(fd: int = 0) -> None:
    """Move the lifeline pipe off ``fd`` and die with the group when it closes."""
    lifeline = os.dup(fd)
    os.set_inheritable(lifeline, False)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    threading.Thread(target=_watch, args=(lifeline,), name="taas-lifeline", daemon=True).start()


_watchdog: int | None = None


def prctl(option: int, argument: object) -> bool:
    """Linux's ``prctl(option, argument)``, written once; False where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, argument, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_watchdog(fd: int = 0) -> None:
    """Fork the watchdog over the lifeline ``fd``. Call while the process is single-threaded."""
    global _watchdog
    rank = os.getpid()
    pid = os.fork()
    if pid != 0:
        _watchdog = pid
        return
    try:  # the watchdog: nothing here may print or raise into the rank's pipes
        prctl(PR_SET_NAME, ctypes.c_char_p(WATCHDOG_NAME))
        # The stop ladder's INT and TERM are for the rank; the watchdog goes on the hang-up
        # that follows, or with the group's KILL.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for target in (1, 2):  # never hold the rank's output pipes open
            os.dup2(devnull, target)
        os.closerange(max(fd, 2) + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: only hang-up and errors wake us, never data
        while not any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, events in poller.poll()):
            pass
        if os.getppid() == rank:  # the rank lives (else we were re-parented: its tree is not ours to walk)
            for pid in descendants(rank):  # what left the group: the rank is their subreaper
                if pid != os.getpid():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(0)


def end_watchdog() -> None:
    """Before exiting: stop and reap the watchdog, so it is never left for init to reap."""
    global _watchdog
    if _watchdog is None:
        return
    try:
        os.kill(_watchdog, signal.SIGKILL)
        os.waitpid(_watchdog, 0)
    except (ProcessLookupError, ChildProcessError, PermissionError):
        pass
    _watchdog = None


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel (Linux) to signal us when our parent dies; act on it."""
    signal.signal(signal.SIGTERM, kill_own_group)
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))  # not Linux: the lifeline thread alone guards us
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        kill_own_group()


def flush_periodically(stream: IO[str], interval: float) -> None:
    """Flush ``stream`` every ``interval`` seconds from a daemon thread (output stays live)."""

    def flush() -> None:
        while True:
            time.sleep(interval)
            try:
                stream.flush()
            except (OSError, ValueError):
                return  # closed, or the pipe is gone: the rank is ending

    threading.Thread(target=flush, name="taas-flush", daemon=True).start()


def adopt_orphans() -> None:
    """Become a child subreaper (Linux): what the cell starts and then leaves (a double fork, a
    daemon) is re-parented to this process instead of init, so it stays a descendant we can end."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc's children lists (parents before their children).
    Never below init: that would be every process of the machine."""
    if pid <= 1:
        return []
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    kids = [int(kid) for kid in children.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(kids)
            frontier.extend(kids)
    return found


SWEEP_ROUNDS = 50  # at most this many passes, 5 ms apart (one that finds nothing below us ends it)


def kill_descendants() -> None:
    """SIGKILL everything this process started, directly or not (it is ending: so do they).

    Pass after pass, reaping our dead children in between, until a pass finds nothing at all
    below us: an orphan re-parented to us (we are its subreaper) while a pass looked was below
    a parent that exited meanwhile, so that pass saw only the parent, dead; the next one sees it."""
    for _ in range(SWEEP_ROUNDS):
        found = descendants(os.getpid())
        for pid in found:
            if not _dead(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        _reap_children()
        if not found:
            return
        time.sleep(0.005)


def _dead(pid: int) -> bool:
    """A zombie (or gone): nothing left to kill."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def _reap_children() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass

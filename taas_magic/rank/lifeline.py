"""A rank never outlives the kernel that started it, nor leaves its children behind.

Two independent guards, as ipykernel's parent poller and torch's spawn do:

- the lifeline: the kernel holds the write end of the rank's stdin pipe for the whole
  run. A daemon thread blocks reading it; end-of-file means the kernel is gone (or
  dropped the run), and the thread kills the rank's whole process group, so commands
  the cell started (``!sleep 100``) die too. The pipe is moved off fd 0 first, so the
  cell and its subprocesses read /dev/null, as in a script.
- the parent-death signal: ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, and a SIGTERM handler
  that kills the group; it covers a lifeline thread that cannot run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


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


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel (Linux) to signal us when our parent dies; act on it."""
    signal.signal(signal.SIGTERM, kill_own_group)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the lifeline thread alone guards us
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        kill_own_group()


def flush_periodically(stream, interval: float) -> None:
    """Flush ``stream`` every ``interval`` seconds from a daemon thread (output stays live)."""

    def flush() -> None:
        while True:
            time.sleep(interval)
            try:
                stream.flush()
            except (OSError, ValueError):
                return  # closed, or the pipe is gone: the rank is ending

    threading.Thread(target=flush, name="taas-flush", daemon=True).start()

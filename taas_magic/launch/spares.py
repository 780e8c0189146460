"""Warm spares: rank processes started ahead of time, with Python and torch imported.

After a taas cell (and on ``%taas warm N``) the kernel keeps N spares. The next cell with
that many ranks or fewer takes them instead of starting fresh processes, so it skips the
interpreter start and the torch imports (about a second each here). A spare is taken
once: every cell still gets fresh processes, no state passes from one cell to the next.
What a spare imported with does not count: it adopts the launch's environment and
working directory when taken (rank/spare.py), and the write rule is applied after that.

Spares die with the kernel: a spare blocks reading its stdin, whose write end only the
kernel holds, and exits at end-of-file. ``%taas warm off`` and unloading the extension
stop them at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from ..procs import reap, signal_group
from ..rank.spare import WAITING_NAME

SPARE_COMMAND = (sys.executable, "-m", "taas_magic.rank", "--spare")
# One thread while importing, so the spare stays single-threaded (rank/spare.py).
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SparePool:
    def __init__(self) -> None:
        self.spares: list[subprocess.Popen] = []

    def take(self, count: int) -> list[subprocess.Popen] | None:
        """``count`` spares that finished warming up, or None (then none is taken).

        A spare still importing would make the cell wait for its whole warm-up, which is
        longer than a fresh start: those stay in the pool for a later cell.
        """
        self._drop_dead()
        ready = [process for process in self.spares if _is_ready(process)]
        if len(ready) < count:
            # Fresh processes start instead; spares still warming would only compete
            # with them for the CPU, so they go (the pool refills after the cell).
            self.close()
            return None
        taken = ready[:count]
        self.spares = [process for process in self.spares if process not in taken]
        return taken

    def fill(self, count: int) -> None:
        """Start spares until ``count`` are waiting (or stop the extra ones)."""
        self._drop_dead()
        if len(self.spares) > count:
            extra, self.spares = self.spares[count:], self.spares[:count]
            _stop(extra)
        env = {**os.environ, **SINGLE_THREADED}
        while len(self.spares) < count:
            try:
                self.spares.append(subprocess.Popen(
                    SPARE_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    env=env, cwd=os.getcwd(), start_new_session=True, close_fds=True,
                ))
            except OSError:
                return  # the next cell starts fresh processes instead

    def resident_bytes(self) -> int:
        """The spares' resident memory, from /proc (what keeping them costs)."""
        total = 0
        for process in self.spares:
            try:
                with open(f"/proc/{process.pid}/statm") as statm:
                    total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                pass
        return total

    def close(self) -> None:
        _stop(self.spares)
        self.spares = []

    def _drop_dead(self) -> None:
        alive = [process for process in self.spares if process.poll() is None]
        _stop([process for process in self.spares if process.poll() is not None])
        self.spares = alive


def _is_ready(process: subprocess.Popen) -> bool:
    """A spare names itself ``taas-spare`` once warm (rank/spare.py)."""
    try:
        with open(f"/proc/{process.pid}/comm", "rb") as comm:
            return comm.read().strip() == WAITING_NAME
    except OSError:
        return False


def _stop(processes: list[subprocess.Popen]) -> None:
    """Kill at once: a waiting spare holds nothing worth a graceful stop."""
    for process in processes:
        signal_group(process.pid, signal.SIGKILL)
    for process in processes:
        reap(process)

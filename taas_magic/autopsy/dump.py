"""The rank's half of the hang autopsy: Python's faulthandler, armed on a signal.

Runs in each rank: armed on its main thread before the cell; the dump itself is written by
faulthandler, from C, in the signal handler.

``faulthandler`` answers a signal from C, in the signal handler itself, without taking the
GIL: it walks every thread's frames and writes them to a file descriptor. So a rank blocked
in C code that holds the GIL (a collective, a C extension) still answers, where anything
written in Python (a thread, a signal handler) would wait forever. The kernel's half is
``taas_magic/autopsy/stacks.py``; the file is owner-only, ``<run's stacks dir>/rank-<k>``
(:func:`stack_file`: the kernel names the folder in the run spec, and the launcher that
reads the dumps uses the same name). A ``main 0x...`` line names the main thread, written
once the handler is armed, so the kernel signals only a rank that will answer; a file
that cannot be opened leaves that rank without an autopsy, and the run goes on.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

STACK_SIGNAL = signal.SIGRTMIN + 5  # a real-time signal nothing else here uses (not SIGUSR1/2: SLURM, Lightning)
MAIN_PREFIX = "main "


def stack_file(stacks_dir: str, rank: int) -> str:
    """Where rank ``rank`` of a run whose stacks folder is ``stacks_dir`` writes its dumps."""
    return os.path.join(stacks_dir, f"rank-{rank}")


def arm(path: str) -> None:
    """Answer STACK_SIGNAL with every thread's stack, appended to ``path`` (empty: no autopsy)."""
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return  # no autopsy for this rank; the run goes on
    os.set_inheritable(fd, False)
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    os.write(fd, f"{MAIN_PREFIX}0x{threading.main_thread().ident:016x}\n".encode())

"""Where taas keeps its temporary files, and how they are removed, written once.

Runs wherever it is imported: in the kernel (a run's folders, made in its plan step and removed as
it ends), in each rank (transfer/memfile.py's files), in a data worker (feed/segments.py) and in a
Ray host agent or Slurm task (its host's cache folders).

Every directory or file a run creates in a shared place is named ``<prefix><kernel pid>-...``
and is owner-only: the kernel removes its own when the cell ends, and :func:`sweep_orphans`
removes those whose kernel died (a later run of any kernel calls it). Memory first
(``/dev/shm``) for what is read often and soon, disk (``$TAAS_SPILL_DIR`` or the temp dir)
for what does not fit.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from typing import Callable

from taas_magic.procs import pid_alive

SHM = "/dev/shm"


def spill_root() -> str:
    return os.environ.get("TAAS_SPILL_DIR") or tempfile.gettempdir()


def ram_root() -> str:
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()


def memory_dir(size: int) -> str:
    """``/dev/shm`` when it is writable and has room for ``size`` bytes, else the temp dir."""
    try:
        stats = os.statvfs(SHM)
        if os.access(SHM, os.W_OK) and stats.f_bavail * stats.f_frsize > size + (64 << 20):
            return SHM
    except OSError:
        pass
    return tempfile.gettempdir()


def remove_tree(path: str) -> None:
    """rmtree that also clears overlayfs's mode-000 work directories."""

    def make_writable_and_retry(function: Callable[[str], object], target: str, _excinfo: object) -> None:
        parent = os.path.dirname(target)
        for item in (parent, target):
            try:
                os.chmod(item, stat.S_IRWXU)
            except OSError:
                pass
        function(target)

    shutil.rmtree(path, onerror=make_writable_and_retry)


def sweep_orphans(directory: str | None = None, prefix: str = "taas-scratch-") -> None:
    """Remove what killed kernels left: entries ``<prefix><pid>-...`` whose kernel is gone."""
    directory = directory or tempfile.gettempdir()
    for name in os.listdir(directory):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            if os.path.isdir(path):
                remove_tree(path)
            else:  # a memory file (tensor data, a closure)
                os.unlink(path)
        except FileNotFoundError:
            pass  # another kernel swept it first

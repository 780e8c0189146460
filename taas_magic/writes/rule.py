"""The write rule: only rank 0 writes to the repository (kernel side).

Runs in the kernel: the rule decided in a run's plan step, the layers reported and removed as the
run releases them (the run's own thread), the overlay probed once (on a helper thread as the
extension loads, or the cell's) in a namespace helper process (writes/namespace.py).

The repository is, in order: what ``%taas config repo PATH`` set, the ``TAAS_REPO``
environment variable, the top of the git work tree holding the kernel's working
directory, or that directory itself. Ranks other than 0 get a private scratch layer
each (writes/namespace.py mounts it over the repository); the layers are read for the
report and removed when the cell ends.

Whether this host allows the overlay is probed once per kernel, in a throwaway process.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache

from taas_magic.tempdirs import remove_tree, sweep_orphans
from taas_magic.writes.layer import inside, inside_any

OVERLAY = "overlay"
PYTHON = "python"
MODES = ("auto", OVERLAY, PYTHON)


def find_repository(cwd: str, configured: str | None = None) -> str:
    chosen = configured or os.environ.get("TAAS_REPO")
    if chosen:
        return os.path.realpath(os.path.expanduser(chosen))
    here = os.path.realpath(cwd)
    probe = here
    while True:
        if os.path.exists(os.path.join(probe, ".git")):
            return probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return here
        probe = parent


_probing = threading.Lock()  # the session's early probe and a first cell's ask wait for one probe


def probe_overlay() -> str | None:
    """None when the namespaces and the overlay mount work here, else why not (probed once per kernel)."""
    with _probing:
        return _probe_overlay_once()


def probe_overlay_soon() -> None:
    """Probe now, on a thread of its own: the session does as the extension loads, so that a fresh kernel's
    first cell does not wait for the probe's interpreter (50-70 ms here) before its ranks start."""
    def probe() -> None:
        try:
            probe_overlay()
        except Exception:  # noqa: BLE001 - not cached: the first cell probes again and says why there
            pass

    threading.Thread(target=probe, name="taas-probe-overlay", daemon=True).start()


@lru_cache(maxsize=1)
def _probe_overlay_once() -> str | None:
    lower, scratch = tempfile.mkdtemp(prefix="taas-probe-"), tempfile.mkdtemp(prefix="taas-probe-")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "taas_magic.writes.namespace", lower, scratch],
            capture_output=True, text=True, timeout=30,
        )
    finally:
        remove_tree(lower)
        remove_tree(scratch)
    if run.returncode == 0:
        return None
    output = (run.stdout + run.stderr).strip().splitlines()
    return output[-1] if output else f"the probe exited with code {run.returncode}"


def resolve_shared(folders: tuple[str, ...], repository: str, cwd: str) -> tuple[str, ...]:
    """``--shared``'s folders, absolute (relative ones from ``cwd``, the kernel's working directory).

    Raises:
        ValueError: a folder is outside the repository (where no write is diverted), or is the
            repository itself (the write rule would be gone); the message names it.
    """
    resolved = []
    for folder in folders:
        full = os.path.realpath(os.path.join(cwd, os.path.expanduser(folder)))
        if full == repository:
            raise ValueError(f"--shared {folder}: that is the whole repository {repository}; "
                             "name the folder of the checkpoint")
        if not inside(full, repository):
            raise ValueError(f"--shared {folder}: {full} is outside the repository {repository}, "
                             "where every rank writes in place already")
        resolved.append(full)
    return tuple(resolved)


def choose_rule(repository: str, wanted: str) -> "WriteRule":
    """The overlay where the host allows it (or ``wanted`` says python), else Python's."""
    if wanted == PYTHON:
        return WriteRule(repository, PYTHON, "chosen with %taas config isolation python")
    reason = probe_overlay()
    if reason is None:
        return WriteRule(repository, OVERLAY)
    return WriteRule(repository, PYTHON, f"user namespaces or overlay mounts unavailable: {reason}")


@dataclass(frozen=True)
class WriteRule:
    repository: str
    mode: str
    reason: str | None = None

    def header(self) -> str:
        if self.mode == OVERLAY:
            return f"repository {self.repository} · other ranks' writes there are diverted (overlay)"
        return (
            f"repository {self.repository} · other ranks' writes there are diverted by Python ({self.reason}); "
            "writes by their subprocesses and C extensions other than torch.save are NOT diverted"
        )


class ScratchLayers:
    """One private scratch directory per rank other than 0 and per data worker, removed by :meth:`remove`."""

    PREFIX = "taas-scratch-"

    def __init__(self, world_size: int, workers: int = 0):
        sweep_orphans()
        # 0700: the ranks' diverted files. The kernel's pid in the name lets a later run
        # sweep the layers of a kernel that was killed before it could remove them.
        self.root = tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-")
        self.dirs = {rank: os.path.join(self.root, f"rank{rank}") for rank in range(1, world_size)}
        self.worker_dirs = {worker: os.path.join(self.root, f"worker{worker}") for worker in range(workers)}
        for path in (*self.dirs.values(), *self.worker_dirs.values()):
            os.mkdir(path, 0o700)

    def report(self, repository: str, shared: tuple[str, ...] = (), fate: str = "diverted and discarded") -> list[str]:
        """One line per rank whose writes were diverted: how many changes, the first path, and ``fate``. ``shared``:
        the folders written in place (absolute; writes/savers.py), and the folders above them, are not changes:
        the overlay's mount points for them stay in a rank's layer, also once rank 0 rotated them away."""
        lines = []
        named = [(f"rank {rank}", path) for rank, path in self.dirs.items()]
        named += [(f"data worker {worker}", path) for worker, path in self.worker_dirs.items()]
        written_in_place = [os.path.relpath(folder, repository) for folder in shared]
        for who, path in named:
            log = os.path.join(path, "changes.log")  # kept by the Python diversion
            if os.path.exists(log):
                with open(log) as handle:
                    changes = [line.rstrip("\n") for line in handle]
            else:
                changes = _changes(os.path.join(path, "upper"), repository)
            changes = [change for change in changes if not _in_or_above(change, written_in_place)]
            if changes:
                lines.append(
                    f"taas: {who} tried to change {len(changes)} path(s) in the repository; "
                    f"{fate} (first: {changes[0]})"
                )
        return lines

    def use_workers(self, workers: int) -> None:
        """Kept ranks' layers: this cell's data workers get fresh ones, the last cell's workers' are removed."""
        for path in self.worker_dirs.values():
            remove_tree(path)
        self.worker_dirs = {worker: os.path.join(self.root, f"worker{worker}") for worker in range(workers)}
        for path in self.worker_dirs.values():
            os.mkdir(path, 0o700)

    def remove(self) -> None:
        remove_tree(self.root)


def _in_or_above(relative: str, folders: list[str]) -> bool:
    """Whether ``relative`` is one of ``folders``, under one, or a folder above one."""
    return inside_any(relative, folders) or any(inside(folder, relative) for folder in folders)


def _changes(upper: str, repository: str) -> list[str]:
    """Every changed path in an overlay upper layer, oldest first (whiteouts are deletions)."""
    found: list[tuple[float, str]] = []
    if not os.path.isdir(upper):
        return []
    for directory, subdirs, files in os.walk(upper):
        for name in files + subdirs:
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, upper)
            info = os.lstat(full)
            if stat.S_ISDIR(info.st_mode) and os.path.isdir(os.path.join(repository, relative)):
                continue  # an existing directory copied up only because something inside changed
            found.append((info.st_mtime, relative))
    return [relative for _, relative in sorted(found)]

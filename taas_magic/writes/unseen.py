"""On a host that does not see the notebook's repository: its names, and one clear line for a file not there.

Runs in the kernel (:func:`names`, in a cluster run's plan step, for each cell's spec) and in a rank on
an away host (writes/away.py; :func:`enter` from writes/outbox.py at start-up, :func:`mark` at each cell's
start, the audit hook on whichever thread opens a file).

A rank there sees the host's own folder at the repository's path (a copy, or an empty stand-in), never what
rank 0 writes on the notebook's host. A program that resumes (``if os.path.exists(ckpt): load(ckpt)``)
would then take another branch there than rank 0 does, and the ranks would wait for each other forever.
So each cell's spec carries the repository's files as the kernel sees them as the cell starts (path and
size; the first :data:`MAX_NAMES`, shallowest first; hidden folders, ``__pycache__`` and ``node_modules`` left
out), and the rank makes
every one its host lacks, or holds at another size, a *placeholder* in its own view: an empty file of
that size (sparse) that no one may read (mode 000). The name is there, so the branch is the same as
rank 0's; opening it raises :class:`UnseenFileError`, one line that says which file and why, and the
cell fails there rather than diverging. A file of the same size is taken to be the same (a node's own
copy of the code).

A placeholder stops being one when the rank writes the name anew (an ``open`` that truncates, or an
``os.replace`` onto it) or removes it. Placeholders are in the rank's private layer, never sent to the
notebook's repository (writes/outbox.py asks :func:`placeholder`). C code that reads such a file
itself gets EACCES (or, as root, zeros); only Python's ``open`` (``torch.load``, ``numpy.load``,
``pathlib``, DCP's reader) gets the line.
"""

from __future__ import annotations

import os
import stat
import sys
from collections import deque
from typing import Any

MAX_NAMES = 20000  # files listed per cell; a repository with more has its shallowest listed
SKIPPED = ("__pycache__", "node_modules")  # folders not listed, nor hidden ones (.git, .taas, .venv, .ipynb_checkpoints)
_WRITES = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


class UnseenFileError(RuntimeError):
    """A file of the notebook's repository that this host does not have was opened (not an ``OSError``: a
    program's ``except FileNotFoundError`` must not take it for a missing checkpoint and start afresh)."""


def names(repository: str, limit: int = MAX_NAMES) -> tuple[tuple[str, int], ...]:
    """The repository's regular files (relative path, size), shallowest first, at most ``limit``."""
    found: list[tuple[str, int]] = []
    folders = deque([""])
    while folders and len(found) < limit:
        folder = folders.popleft()
        try:
            entries = sorted(os.scandir(os.path.join(repository, folder)), key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            relative = os.path.join(folder, entry.name)
            try:
                if entry.is_dir(follow_symlinks=False):
                    if not entry.name.startswith(".") and entry.name not in SKIPPED:
                        folders.append(relative)
                elif entry.is_file(follow_symlinks=False) and len(found) < limit:
                    found.append((relative, entry.stat(follow_symlinks=False).st_size))
            except OSError:
                continue
    return tuple(found)


class _Unseen:
    """This rank's placeholders (relative to the repository) and where its view and its layer hold them."""

    def __init__(self, repository: str, upper: str):
        self.repository = repository
        self.upper = upper
        self.sizes: dict[str, int] = {}
        self.making = False
        self.hooked = False

    def relative(self, path: Any) -> str | None:
        """``path`` relative to the repository, through the view or through the layer (the Python fallback
        opens a rank's own files there); None when it is neither or not a path."""
        if isinstance(path, int) or path is None:
            return None
        try:
            full = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return None
        for root in (self.repository, self.upper):
            if full.startswith(root + os.sep):
                return full[len(root) + 1:]
        return None

    def make(self, relative: str, size: int) -> None:
        path = os.path.join(self.repository, relative)
        try:
            held = os.stat(path)
        except FileNotFoundError:
            held = None
        except OSError:
            return  # a file where the name's folder would be: left as it is
        if held is not None and relative not in self.sizes and (not stat.S_ISREG(held.st_mode) or held.st_size == size):
            return  # the host has it (a file of the same size is taken to be the same), or a folder by that name
        if held is not None and self.sizes.get(relative) == size:
            return  # a placeholder already, of that size
        try:
            if held is not None:
                os.unlink(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(descriptor, size)
            finally:
                os.close(descriptor)
            os.chmod(path, 0)
        except OSError:
            return
        self.sizes[relative] = size

    def hook(self, event: str, args: tuple) -> None:
        """The audit hook: opening a placeholder raises; writing one anew, replacing or removing it frees it."""
        if self.making or not self.sizes:
            return
        if event == "open":
            relative = self.relative(args[0])
            if relative is None or relative not in self.sizes:
                return
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and "w" in mode) or (isinstance(flags, int) and flags & os.O_TRUNC):
                self._free(relative)  # written anew: the rank's own file from now on
                return
            raise UnseenFileError(_line(relative, writes=isinstance(flags, int) and bool(flags & _WRITES)))
        elif event == "os.rename":
            source, target = self.relative(args[0]), self.relative(args[1])
            size = self.sizes.pop(source, None) if source is not None else None
            if target is not None:
                self.sizes.pop(target, None)  # replaced: the rank's own file from now on
                if size is not None:
                    self.sizes[target] = size  # a placeholder moved is one still
        elif event == "os.remove":
            self.sizes.pop(self.relative(args[0]) or "", None)

    def _free(self, relative: str) -> None:
        self.sizes.pop(relative, None)
        try:
            os.chmod(os.path.join(self.repository, relative), 0o600)
        except OSError:
            pass


def _line(relative: str, writes: bool) -> str:
    doing = "changed" if writes else "read"
    return (f"{relative} cannot be {doing} here: this host does not see the notebook's repository, which holds the "
            f"file (rank 0 saved it, or this host's copy differs); put the repository on a filesystem every host "
            f"sees, or copy the file to this host")


_unseen: _Unseen | None = None


def enter(repository: str, upper: str) -> None:
    """Rank start-up on an away host: this rank's view of the repository and its layer's upper folder."""
    global _unseen
    _unseen = _Unseen(os.path.realpath(repository), os.path.realpath(upper))


def mark(listed: tuple[tuple[str, int], ...]) -> None:
    """Each cell's start on an away host: every listed file this host lacks (or holds at another size) made
    a placeholder in this rank's view. Nothing elsewhere."""
    unseen = _unseen
    if unseen is None or not listed:
        return
    unseen.making = True
    try:
        for relative, size in listed:
            unseen.make(relative, size)
    finally:
        unseen.making = False
    if unseen.sizes and not unseen.hooked:
        sys.addaudithook(unseen.hook)
        unseen.hooked = True


def placeholder(relative: str) -> bool:
    """Whether ``relative`` (to the repository) is a placeholder of this rank: never sent to the notebook's."""
    return _unseen is not None and relative in _unseen.sizes

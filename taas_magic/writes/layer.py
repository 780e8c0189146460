"""A rank's private layer over the repository, kept by Python: the bookkeeping of divert.py.

Runs in a rank under the Python fallback (writes/divert.py, writes/shared.py), on whichever thread
writes, and in the kernel, whose write rule asks where a path is (writes/rule.py).

Given a repository and a layer directory, :class:`Layer` says where a path is read and
written: a path under the repository (compared after ``os.path.abspath``, not ``realpath``,
so a symbolic link from outside into it is not followed; the layer itself is never inside)
reads from ``<layer>/upper`` once it is there, else from the repository unless a tombstone
hides it; it is written in ``upper``, its file or tree copied up first when the write
changes what exists. A delete removes the upper copy and leaves a tombstone (a set in this
process: a deleted directory hides everything under it). Every path written or deleted is
appended once to ``<layer>/changes.log``, which the kernel reports (writes/rule.py). A
path under a shared directory (writes/shared.py: a collective checkpoint's folder) is
not the layer's: it is read and written in place.

It patches nothing. It calls the ``os``/``shutil`` functions of the moment (patched by
divert.py while the diversion is installed: its own paths are outside the repository, so
those pass them through), except the few taken when it is made, which it must call unpatched.
"""

from __future__ import annotations

import builtins
import os
import shutil
from typing import Any, Callable, Iterable


def inside(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or under it (both absolute and normalised)."""
    return path == root or path.startswith(root + os.sep)


def inside_any(relative: str, folders: Iterable[str]) -> bool:
    """Whether ``relative`` (to the repository) is one of ``folders`` or under one (``.``: the whole repository)."""
    return any(folder == "." or inside(relative, folder) for folder in folders)


class Layer:
    """Where each path under the repository is read and written, copy-up and the tombstones."""

    def __init__(self, repository: str, layer: str):
        self.repository = os.path.realpath(repository)
        self.root = os.path.realpath(layer)
        self.upper = os.path.join(self.root, "upper")
        self.log_path = os.path.join(layer, "changes.log")
        self.deleted: set[str] = set()
        self.logged: set[str] = set()
        self.shared: tuple[str, ...] = ()  # directories written in place (writes/shared.py), relative
        os.makedirs(self.upper, exist_ok=True)
        self.real_open = builtins.open  # taken now, before divert.py patches them
        self.real_unlink = os.unlink
        self.real_mkdir = os.mkdir  # writes/shared.py makes a shared directory in the repository itself
        self.real_rmtree = shutil.rmtree
        self.real_listdir = os.listdir

    def relative(self, path: Any) -> str | None:
        """``path`` relative to the repository; None when it is not under it (or is a descriptor)."""
        if isinstance(path, int):
            return None
        try:
            # IMPORTANT: abspath, not realpath: realpath calls os.lstat, which is patched.
            full = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return None
        if not inside(full, self.repository) or inside(full, self.root):
            return None
        relative = os.path.relpath(full, self.repository)
        if inside_any(relative, self.shared):
            return None  # written in place: a collective checkpoint's folder
        return relative

    def is_deleted(self, relative: str) -> bool:
        return any(inside(relative, gone) for gone in self.deleted)

    def for_reading(self, path: Any) -> Any:
        """Where ``path`` is read: its upper copy, a path that does not exist (deleted), or itself."""
        relative = self.relative(path)
        if relative is None:
            return path
        upper = os.path.join(self.upper, relative)
        if os.path.lexists(upper):
            return upper
        if self.is_deleted(relative):
            return os.path.join(self.upper, ".taas-deleted", relative)  # does not exist
        return path

    def for_writing(self, path: Any, copy_up: bool) -> Any:
        """Where ``path`` is written (its upper copy, made from what it was if ``copy_up``); logged."""
        relative = self.relative(path)
        if relative is None:
            return path
        upper = os.path.join(self.upper, relative)
        os.makedirs(os.path.dirname(upper), exist_ok=True)
        source = self.for_reading(path)
        if copy_up and source != upper and os.path.exists(source) and not os.path.exists(upper):
            if os.path.isdir(source):
                shutil.copytree(source, upper, symlinks=True)
            else:
                shutil.copy2(source, upper)
        if relative in self.deleted:  # made again (rmtree, then makedirs): what the repository's folder held stays deleted
            try:
                held = self.real_listdir(os.path.join(self.repository, relative))
            except (FileNotFoundError, NotADirectoryError):
                held = []
            self.deleted.update(os.path.join(relative, name) for name in held)
        self.deleted.discard(relative)
        self.log(relative)
        return upper

    def log(self, relative: str) -> None:
        if relative not in self.logged:
            self.logged.add(relative)
            with self.real_open(self.log_path, "a") as log:
                log.write(relative + "\n")

    def delete(self, path: Any, is_dir: bool) -> None:
        """Remove ``path``'s upper copy and leave its tombstone; logged."""
        relative = self.relative(path)
        assert relative is not None, "called only for paths inside the repository"
        upper = os.path.join(self.upper, relative)
        if os.path.lexists(upper):
            (self.real_rmtree if is_dir and not os.path.islink(upper) else self.real_unlink)(upper)
        self.deleted.add(relative)
        self.log(relative)

    def names(self, relative: str, listdir: Callable[[str], list[str]]) -> list[str]:
        """The directory ``relative``'s entries as the rank sees them: the repository's and the
        upper's, less the deleted (``listdir``: the unpatched one)."""
        names = set()
        base = os.path.join(self.repository, relative)
        if not self.is_deleted(relative):
            # IMPORTANT: not os.path.isdir(base): its stat is diverted, and sees the upper's copy of a
            # directory this rank made that the repository lacks (yet: rank 0 makes it in a moment).
            try:
                names.update(listdir(base))
            except (FileNotFoundError, NotADirectoryError):
                pass
        upper = os.path.join(self.upper, relative)
        if os.path.isdir(upper):
            names.update(listdir(upper))
        return sorted(name for name in names if not self.is_deleted(os.path.normpath(os.path.join(relative, name))))

"""Inside a rank other than 0: divert every write under the repository to a scratch layer.

Runs in a rank other than 0 (and in a GPU spare that will be one), on its main thread before any
other thread starts, and in the namespace helper, the kernel's probe of whether this host allows it
(``python -m taas_magic.writes.namespace LOWER SCRATCH``, started by writes/rule.py).

An unprivileged user + mount namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNS)``) with an
overlay mount over the repository: the repository is the lower layer (reads see it as
it is), the rank's private scratch directory is the upper layer (every create,
overwrite, append, truncate, delete, rename, mkdir and chmod lands there). It covers
every way of writing at once, C++ writers and subprocesses included, because it lives in
the kernel's VFS, not in Python. The uid and gid map to themselves, so the rank keeps
its own identity; devices, ``/dev/shm`` and the network are untouched.

IMPORTANT: ``unshare(CLONE_NEWUSER)`` refuses a multi-threaded process, so this runs
before the rank starts any thread (the lifeline thread included). A warm spare bound to a
GPU (launch/local/spares.py) makes its CUDA context, which starts threads, before it knows its
cell: a spare that will be rank 1 or above therefore enters its namespaces
(:func:`enter_namespace`) first thing, and only mounts the overlay (:func:`mount_overlay`,
which any thread may do) when a cell takes it.

A view is mounted again whenever rank 0's writes must be seen (writes/refresh.py says why and when):
:func:`mount_view` mounts another overlay of the same repository and upper layer at a folder of the
scratch directory, from where refresh.py moves it onto the repository.
"""

from __future__ import annotations

import ctypes
import os

from taas_magic.writes import shared

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_lower: str | None = None  # once mounted: the repository, below the mount (a path through a descriptor)
_scratch = ""  # the rank's scratch directory (its upper layer's)
_views = 0  # views mounted by mount_view: each has a work directory of its own


class IsolationUnavailable(OSError):
    """The kernel refuses the namespaces or the overlay mount."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise IsolationUnavailable(errno, f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def enter_namespace() -> None:
    """A user + mount namespace of our own, the uid and gid mapped to themselves, ``/`` private.

    Raises:
        IsolationUnavailable: user namespaces are not allowed here, or the process has threads.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # Our mounts must not propagate back to the host's mount namespace.
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def mount_overlay(repository: str, scratch: str) -> None:
    """In a namespace :func:`enter_namespace` made: the overlay over ``repository``, changes to ``scratch``.

    Raises:
        IsolationUnavailable: the overlay mount is refused.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    cwd = os.getcwd()
    os.makedirs(os.path.join(scratch, "upper"), exist_ok=True)
    options = _options(repository, scratch, "work")
    shared.keep_repository(repository)  # a way below the mount, for the directories written in place
    try:
        _check(libc.mount(b"overlay", repository.encode(), b"overlay", 0, options), "overlay mount")
    except IsolationUnavailable:
        shared.forget_repository()
        raise
    # The old cwd still points at the directory below the mount: enter the overlay.
    os.chdir(cwd)
    global _lower, _scratch
    # Later views name the lower layer through the descriptor below the mount: the path now shows the overlay.
    _lower, _scratch = shared.repository_below(), scratch


def scratch_dir() -> str | None:
    """This process's scratch directory once its overlay is mounted (None: it has none, or not yet)."""
    return _scratch if _lower is not None else None


def mount_view(target: str) -> str:
    """Another overlay of the same repository and upper layer (the rank's own writes stay) at ``target``, after
    :func:`mount_overlay`; any thread. Its work directory is its own (returned: remove it once the view is gone):
    an overlay mounted with another's empties that one's, and its next copy-up would fail.

    Raises:
        IsolationUnavailable: the overlay mount is refused.
    """
    global _views
    assert _lower is not None, "mount_overlay first"
    _views += 1
    work = f"work-{_views}"
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.mount(b"overlay", target.encode(), b"overlay", 0, _options(_lower, _scratch, work)), "overlay mount")
    return os.path.join(_scratch, work)


def _options(lower: str, scratch: str, work: str) -> bytes:
    """An overlay's mount options: ``lower`` under the rank's upper layer in ``scratch``, with the work folder
    ``work`` there (made here)."""
    os.makedirs(os.path.join(scratch, work), exist_ok=True)
    # userxattr: in a user namespace overlayfs must keep its opaque/whiteout marks in user.* xattrs.
    return (f"lowerdir={lower},upperdir={os.path.join(scratch, 'upper')},workdir={os.path.join(scratch, work)},"
            "userxattr").encode()


def divert_writes(repository: str, scratch: str, in_namespace: bool = False) -> None:
    """Mount a copy-on-write view of ``repository`` whose changes go to ``scratch``
    (entering the namespaces first unless ``in_namespace``).

    Raises:
        IsolationUnavailable: user namespaces or overlay mounts are not allowed here.
    """
    if not in_namespace:
        enter_namespace()
    mount_overlay(repository, scratch)


if __name__ == "__main__":  # the kernel's probe: python -m taas_magic.writes.namespace LOWER SCRATCH
    import sys

    try:
        divert_writes(sys.argv[1], sys.argv[2])
    except OSError as exc:
        print(exc)
        sys.exit(1)

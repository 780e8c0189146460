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

**The view is made again at every point a program may rely on it** (:func:`remount`, called by
writes/refresh.py after each collective and at each kept cell's start). An overlay caches what it has
looked up and never asks its lower layer again: a path rank 1 looked up before rank 0 made it stays
missing, a file rank 0 deleted stays there, and a name rank 0 ``os.replace``-d onto keeps its old
content, for the life of that mount (the kernel documents changes to the lower layer as undefined).
So the rank mounts a new overlay over the same repository and upper layer (the rank's own writes
stay), mounts it *beneath* the one in use (``move_mount(MOVE_MOUNT_BENEATH)``, Linux 6.5) and
detaches the old one on a thread of its own: the path never shows anything but a view (no moment
where the repository itself is there to write), and the old mount's teardown (an RCU grace period,
up to half a second measured) costs the cell nothing. About 0.5 ms. On a kernel without
``MOVE_MOUNT_BENEATH`` the new overlay is mounted on top and the old one stays below it, covered,
until the rank ends. What a refresh cannot reach: processes the rank started before it (a
DataLoader's workers) keep the view they were started with for relative paths (their working
directory), and files already open stay the files they were.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time

from taas_magic.writes import shared

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
SYS_MOVE_MOUNT = 429  # the same number on every architecture (the syscalls added since 5.1 share one table)
AT_FDCWD = -100
MOVE_MOUNT_BENEATH = 0x200
SWITCH_SECONDS = 5.0  # the old view is gone from the path within this long (it takes microseconds)

_options: bytes | None = None  # the overlay's mount options, the lower layer named below the mount
_staging = ""  # an empty folder of the scratch directory where the next view is made
_beneath = True  # this kernel mounts beneath (Linux 6.5); False once it said EINVAL
_detacher: queue.Queue[str] | None = None  # paths whose top mount the detaching thread unmounts


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
    upper, work = os.path.join(scratch, "upper"), os.path.join(scratch, "work")
    os.makedirs(upper, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    # userxattr: in a user namespace overlayfs must keep its opaque/whiteout marks in user.* xattrs.
    options = f"lowerdir={repository},upperdir={upper},workdir={work},userxattr".encode()
    shared.keep_repository(repository)  # a way below the mount, for the directories written in place
    try:
        _check(libc.mount(b"overlay", repository.encode(), b"overlay", 0, options), "overlay mount")
    except IsolationUnavailable:
        shared.forget_repository()
        raise
    # The old cwd still points at the directory below the mount: enter the overlay.
    os.chdir(cwd)
    global _options, _staging
    # Later views name the lower layer through the descriptor below the mount: the path now shows the overlay.
    _options = f"lowerdir={shared.repository_below()},upperdir={upper},workdir={work},userxattr".encode()
    _staging = os.path.join(scratch, "next-view")
    os.makedirs(_staging, exist_ok=True)


def mounted() -> bool:
    """Whether this process's repository is an overlay view (:func:`mount_overlay` succeeded)."""
    return _options is not None


def remount() -> None:
    """A fresh view of the repository in place of the one in use (see the module docstring); its shared
    folders bound again. Any thread; the caller serialises (writes/refresh.py).

    Raises:
        IsolationUnavailable: the new overlay or a bind in it was refused (the old view stays).
    """
    repository = shared.repository()
    assert _options is not None and repository is not None, "mount_overlay first"
    with shared.lock:  # a folder shared meanwhile (a save on another thread) is bound in the view that stays
        _make_next_view()
        _take_its_place(repository)


def _make_next_view() -> None:
    """The new overlay at the staging folder, with the shared folders bound in it."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.mount(b"overlay", _staging.encode(), b"overlay", 0, _options), "overlay mount")
    try:
        shared.bind_all(_staging)
    except OSError as exc:
        libc.umount2(_staging.encode(), MNT_DETACH)
        raise IsolationUnavailable(exc.errno, f"could not bind the shared folders again: {exc}") from exc


def _take_its_place(repository: str) -> None:
    """The view at the staging folder moved onto ``repository`` (beneath the old one, which then goes, or
    on top of it), and the working directory entered again in it."""
    global _beneath
    libc = ctypes.CDLL(None, use_errno=True)
    new_device = os.stat(_staging).st_dev
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        cwd = repository
    if _beneath and _move(libc, repository, MOVE_MOUNT_BENEATH) != 0:
        _beneath = ctypes.get_errno() != 22  # EINVAL: this kernel cannot mount beneath; any other errno is raised
        if _beneath:
            errno = ctypes.get_errno()
            libc.umount2(_staging.encode(), MNT_DETACH)
            raise IsolationUnavailable(errno, f"move_mount beneath: {os.strerror(errno)}")
    elif _beneath:
        _detach_top(repository, new_device)  # moved beneath: the old view, on top, goes
    if not _beneath and _move(libc, repository, 0) != 0:  # on top, the old view covered below it
        errno = ctypes.get_errno()
        libc.umount2(_staging.encode(), MNT_DETACH)
        raise IsolationUnavailable(errno, f"move_mount: {os.strerror(errno)}")
    try:
        os.chdir(cwd)
    except OSError:  # rank 0 removed the folder this rank stood in
        os.chdir(repository)


def _move(libc: ctypes.CDLL, repository: str, flags: int) -> int:
    """``move_mount`` the view made at the staging folder onto ``repository``; 0, or -1 with errno set."""
    return int(libc.syscall(SYS_MOVE_MOUNT, AT_FDCWD, _staging.encode(), AT_FDCWD, repository.encode(), flags))


def _detach_top(path: str, new_device: int) -> None:
    """Unmount the view on top of ``path`` on the detaching thread, and return once ``path`` shows the new one."""
    global _detacher
    if _detacher is None:
        _detacher = queue.Queue()
        threading.Thread(target=_detach_loop, args=(_detacher,), name="taas-view-detach", daemon=True).start()
    _detacher.put(path)
    deadline = time.monotonic() + SWITCH_SECONDS
    while os.stat(path).st_dev != new_device:
        if time.monotonic() > deadline:
            raise IsolationUnavailable(0, f"the old view of {path} was not detached in {SWITCH_SECONDS:.0f} s")
        time.sleep(0)


def _detach_loop(paths: queue.Queue[str]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    while True:
        libc.umount2(paths.get().encode(), MNT_DETACH)  # returns after an RCU grace period: off the cell's thread


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

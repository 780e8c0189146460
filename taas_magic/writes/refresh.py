"""In a rank other than 0: its view of the repository made again wherever a program may rely on rank 0's writes.

Runs in each rank whose writes go to an overlay (writes/namespace.py): :func:`follow_collectives` is installed
by rank/main.py when the cell imports ``torch.distributed``; the refresh then runs on whichever thread
returns from a collective, and on the rank's main thread as each cell begins (:func:`refresh`).

``if rank == 0: prepare(); dist.barrier(); load()`` is in nearly every distributed program (a dataset
download, a tokenizer cache, ``main_process_first``, a checkpoint resume). Under the overlay, rank 1's view
would keep what it saw before rank 0's change (namespace.py says why), and the ranks would take different
branches. So every point where the ranks meet is also a point where rank 1's view becomes the repository as
rank 0 has left it:

- **after every collective** the cell calls through ``torch.distributed`` (:data:`COLLECTIVES`: barriers,
  broadcasts, reductions, gathers, scatters, point-to-point), whether the cell calls it or a library does
  (DCP's planning, accelerate's ``wait_for_everyone``, Lightning's ``barrier``);
- **at every cell's start**, for kept ranks (rank 0 may have written in the cell before, or in the notebook).

What it covers: paths rank 1 looked up before they existed, changes in place, deletions, renames
(``os.replace`` onto an existing name too). The rank's own diverted writes stay, and still shadow only the
paths it wrote: where it and rank 0 both wrote a path, it sees its own (a folder both made shows both
ranks' entries). Not covered: a collective with ``async_op=True`` is a refresh as the call returns, not at
its ``wait()``; collectives made below Python (DDP's gradient all-reduce, FSDP2's and functional
collectives) are none, which costs nothing: a program never hands files over there. The Python fallback
(writes/divert.py) reads the repository itself on every call and needs none of this.

**Why a new view.** An overlay caches every path it has looked up and never asks its lower layer again (the
kernel calls changes to the lower layer undefined): a path rank 1 looked up before rank 0 made it stays
missing, a file rank 0 deleted stays, a name rank 0 ``os.replace``-d onto keeps its old content, for the
life of that mount. A view no one has looked through yet caches nothing. So :class:`Views` keeps one such
view ready at a folder of the rank's scratch directory (another overlay of the same repository and upper
layer: the rank's own writes stay) and, at each refresh, on the refreshing thread:

1. binds the folders written in place (writes/shared.py: collective checkpoints) in it, those rank 0 has
   not removed since;
2. moves it onto the repository *beneath* the view in use (``move_mount(MOVE_MOUNT_BENEATH)``, Linux 6.5),
   moves the old one, on top, off the path, and enters the working directory again in the new one: about
   20 microseconds, and the path never shows anything but a view (no moment where the repository itself is
   there to write);
3. a thread unmounts the old view and drops it (an RCU grace period, up to half a second measured, and its
   teardown: every path it cached), and another makes the next one ready (an overlay mount, about 0.3 ms).

On a kernel without ``MOVE_MOUNT_BENEATH`` the new view goes on top, and the old ones stay covered below it
until the rank ends. The cost, in ranks other than 0 only, for each collective called from Python:
``bench/repoview.py`` measures it. A refresh that fails (the host refused the mount) is said once on the
rank's stderr, and the rank goes on with the view it has.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import shutil
import sys
import threading
from types import ModuleType
from typing import Any, Callable

from taas_magic.writes import namespace, shared

COLLECTIVES = (
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "all_reduce", "all_reduce_coalesced",
    "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "gather",
    "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "send", "recv", "send_object_list", "recv_object_list", "batch_isend_irecv",
)
SYS_MOVE_MOUNT = 429  # the same number on every architecture (the syscalls added since 5.1 share one table)
AT_FDCWD = -100
MOVE_MOUNT_BENEATH = 0x200
MNT_DETACH = 2
EINVAL = 22

_lock = threading.Lock()  # one refresh at a time (a save's thread and the cell's can both return from one)
_views: Views | None = None
_failed = False  # the host refused a refresh once: said, and not tried again


class Views:
    """A rank's views of the repository: the one in use at its path, the next one made ready, the old ones dropped."""

    def __init__(self, repository: str, scratch: str):
        self.repository = repository
        self.next, self.gone = os.path.join(scratch, "next-view"), os.path.join(scratch, "old-views")
        os.makedirs(self.next, exist_ok=True)
        os.makedirs(self.gone, exist_ok=True)
        self.beneath = True  # this kernel mounts beneath (Linux 6.5); False once it said EINVAL
        self.ready = threading.Event()  # the next view is there to take
        self.taken = threading.Event()  # it was taken: make another
        self.failure: OSError | None = None  # the next view could not be made
        self.old: queue.Queue[tuple[int, str]] = queue.Queue()  # the views off the path: a descriptor, a work folder
        self.work = ""  # the work folder of the view in use: the first view's stays until the scratch goes
        self.next_work = ""  # the next view's
        threading.Thread(target=self._make, name="taas-next-view", daemon=True).start()
        threading.Thread(target=self._drop, name="taas-old-views", daemon=True).start()

    def switch(self) -> None:
        """The next view in place of the one in use (steps 1 and 2 of the module docstring).

        Raises:
            OSError: the next view could not be made, or moved.
        """
        self.ready.wait()
        if self.failure is not None:
            raise self.failure
        with shared.lock:  # a folder shared meanwhile (a save on another thread) is bound in the view that stays
            shared.bind_all(self.next)
            try:
                cwd = os.getcwd()
            except FileNotFoundError:
                cwd = self.repository
            old = os.open(self.repository, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # its teardown: on the thread
            try:
                self._take_the_next()
            except OSError:
                os.close(old)
                _libc().umount2(self.next.encode(), MNT_DETACH)
                raise
            self.ready.clear()
            try:
                os.chdir(cwd)
            except OSError:  # rank 0 removed the folder this rank stood in
                os.chdir(self.repository)
            self.old.put((old, self.work))  # once nothing of this process stands in it
            self.work = self.next_work
            self.taken.set()  # the staging folder is empty again: the next view may be made there

    def _take_the_next(self) -> None:
        """Beneath the view in use, which then moves off the path (to be dropped); or on top of it."""
        if self.beneath and not _move(self.next, self.repository, MOVE_MOUNT_BENEATH):
            self.beneath = ctypes.get_errno() != EINVAL  # EINVAL: this kernel cannot mount beneath
            if self.beneath:
                _raise("move_mount beneath")
        if not self.beneath:
            if not _move(self.next, self.repository, 0):  # on top: the old view stays below, covered
                _raise("move_mount")
        elif not _move(self.repository, self.gone, 0):  # the old view, on top, off the path: the new one shows
            _raise("move_mount of the old view")

    def _make(self) -> None:
        """The next view, made ready as soon as the last one was taken (step 3)."""
        while True:
            try:
                self.next_work = namespace.mount_view(self.next)
            except Exception as exc:  # noqa: BLE001 - any failure is the next refresh's to say: it waits for this
                self.failure = exc if isinstance(exc, OSError) else OSError(0, f"{type(exc).__name__}: {exc}")
            self.ready.set()
            if self.failure is not None:
                return
            self.taken.wait()
            self.taken.clear()

    def _drop(self) -> None:
        """Each old view unmounted and dropped (step 3): its RCU grace period and its teardown (every path it
        cached) on this thread, not the cell's."""
        while True:
            old, work = self.old.get()
            if self.beneath:
                _libc().umount2(self.gone.encode(), MNT_DETACH)  # one of the old views there: they are all dropped
                os.close(old)
                if work:
                    shutil.rmtree(work, ignore_errors=True)  # a process still in that view can make no new file there
            else:
                os.close(old)  # covered, not gone: its work folder stays
            self.old.task_done()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _move(source: str, target: str, flags: int) -> bool:
    """``move_mount`` the mount at ``source`` onto ``target``; False with errno set when it was refused."""
    return _libc().syscall(SYS_MOVE_MOUNT, AT_FDCWD, source.encode(), AT_FDCWD, target.encode(), flags) == 0


def _raise(what: str) -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, f"{what}: {os.strerror(errno)}")


def refresh() -> None:
    """The repository as it is now, in this process's view (nothing where the view is not an overlay)."""
    global _failed, _views
    scratch = namespace.scratch_dir()
    if _failed or scratch is None:
        return
    with _lock:
        try:
            if _views is None:
                _views = Views(shared.repository() or "", scratch)
            _views.switch()
        except OSError as exc:
            _failed = True
            print(f"taas: this rank's view of the repository can no longer follow rank 0's writes ({exc}); "
                  "what rank 0 writes from now on may not be seen here", file=sys.stderr, flush=True)


def follow_collectives(dist: ModuleType) -> None:
    """Wrap every collective of ``torch.distributed`` (``dist``) and of its ``distributed_c10d`` so that it
    returns with the view refreshed (only where this process's view is an overlay: rank 0 and the Python
    fallback pay nothing)."""
    if namespace.scratch_dir() is None:
        return
    wrappers: dict[Any, Callable[..., Any]] = {}  # one wrapper per function, wherever it is found
    for module in (dist, sys.modules.get("torch.distributed.distributed_c10d")):
        for name in COLLECTIVES if module is not None else ():
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "__taas_view__", False):
                if original not in wrappers:
                    wrappers[original] = _refreshing(original)
                setattr(module, name, wrappers[original])


def _refreshing(collective: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def after_it_the_view_is_refreshed(*args: Any, **kwargs: Any) -> Any:
        result = collective(*args, **kwargs)
        refresh()
        return result

    after_it_the_view_is_refreshed.__taas_view__ = True  # type: ignore[attr-defined]  # wrapped once only
    return after_it_the_view_is_refreshed

"""One communicator of an abortable group (rank/abortable.py): a ``ProcessGroupGloo`` made on the rendezvous store
under a prefix of its own, the sockets it opened, and its end once abandoned: its sockets shut down, so its stuck ops
end, then destroyed once none is left.

Runs in each kept rank: made on the main thread (the group's first, or a renewal before a cell), shut down on the
inbox's reader (the kernel's Abandon), destroyed on the reaper's own thread.

torch 2.13 cannot abort a gloo op (``ProcessGroupGloo.abort()`` does nothing, and a blocked op ends only when its
socket closes or its timeout passes), and destroying a ``ProcessGroupGloo`` joins its threads, so one whose op is
stuck cannot be destroyed. So :meth:`Communicator.shut_down` shuts down the sockets that appeared while it was made
(``shutdown(2)`` on a duplicate of each descriptor, checked to be the same socket by its inode; never its listener,
whose failed ``accept`` ends the process, nor the rendezvous store's connections, which rank 0's store thread may
have accepted meanwhile): gloo then fails its pending ops itself ("Connection closed"), and the
:class:`Reaper` destroys it once they are over. Finding the sockets needs Linux's ``/proc``; elsewhere none are
found, and an abandoned communicator's threads stay until its ops' timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import stat
import threading
import time
from typing import Any

import torch.distributed as dist

REAP_SECONDS = 30.0  # how long an aborted communicator's stuck ops may take to end before it is given up (kept, leaked)


class Communicator:
    """One communicator of a group: a ``ProcessGroupGloo`` on the store under its own prefix, and its sockets."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, after: str):
        before = sockets()
        self.after = after  # the failed run it renews the communicator after ("": the first)
        prefixed = dist.PrefixStore(f"taas-after-{after}/", store) if after else store
        self.gloo = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        self.sockets = {fd: inode for fd, inode in sockets().items() if before.get(fd) != inode}
        self.works: list[Any] = []  # the callers' handles (rank/abortable.py's AbortableWork), until they are done
        self.running = 0  # the communicator's ops not over yet (an abandoned one runs on until its socket ends)
        self._counting = threading.Lock()

    def started(self, work: Any, ops: int) -> None:
        self.works = [each for each in self.works if not each.is_completed()] + [work]
        with self._counting:
            self.running += ops

    def op_over(self) -> None:
        with self._counting:
            self.running -= 1

    def unfinished(self) -> list[Any]:
        self.works = [work for work in self.works if not work.is_completed()]
        return self.works

    def shut_down(self) -> None:
        """Its sockets shut down (each checked to be the same socket still): its ops end with an error now."""
        for fd, inode in self.sockets.items():
            try:
                if os.fstat(fd).st_ino != inode:
                    continue  # closed by gloo, and the number reused: not ours
                with socket.socket(fileno=os.dup(fd)) as shared:
                    if shared.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # its listener: gloo's loop ends the process if accept() fails
                    if _store_port() in (_port(shared.getsockname), _port(shared.getpeername)):
                        continue  # the store's (rank 0 serves it: a new rank's connection came as this one was made)
                    shared.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue

    def settled(self) -> bool:
        """Whether no op of its communicator is left (then destroying it joins idle threads)."""
        return self.running <= 0


class Reaper:
    """Destroys aborted generations once their stuck ops have ended, on a thread of its own (destroying one joins
    its threads, and an op that ends runs Python on them: never with the GIL held for it)."""

    def __init__(self) -> None:
        self._dead: list[tuple[Communicator, float]] = []
        self._reaping = 0  # taken off the list by the thread, not destroyed yet
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self.given_up: list[Communicator] = []  # stuck past REAP_SECONDS: kept, never destroyed

    def take(self, generation: Communicator) -> None:
        with self._lock:
            self._dead.append((generation, time.monotonic() + REAP_SECONDS))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="taas-reaper", daemon=True)
                self._thread.start()
            self._lock.notify()

    def pending(self) -> int:
        """How many aborted generations are not destroyed yet (those being destroyed now count)."""
        with self._lock:
            return len(self._dead) + self._reaping

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._dead:
                    self._thread = None
                    return
                dead, self._dead, self._reaping = self._dead, [], len(self._dead)
            keep = []
            for generation, deadline in dead:
                if generation.settled():
                    generation.works.clear()
                    generation.gloo = None  # type: ignore[assignment]  # the last reference: destroyed here
                elif time.monotonic() > deadline:
                    self.given_up.append(generation)
                else:
                    keep.append((generation, deadline))
            with self._lock:
                self._dead, self._reaping = keep + self._dead, 0
                if keep:
                    self._lock.wait(0.05)


reaper = Reaper()


def _store_port() -> int:
    """The rendezvous store's port (env://'s MASTER_PORT), whose connections are never a communicator's."""
    try:
        return int(os.environ.get("MASTER_PORT", "0"))
    except ValueError:
        return 0


def _port(address: Any) -> int:
    try:
        found = address()
    except OSError:
        return -1
    return found[1] if isinstance(found, tuple) and len(found) > 1 else -1


def sockets() -> dict[int, int]:
    """This process's open sockets: fd -> inode (Linux's /proc; elsewhere none are known, and abort relies on
    failing the callers' works alone)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            status = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if stat.S_ISSOCK(status.st_mode):
            found[int(name)] = status.st_ino
    return found

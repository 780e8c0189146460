"""The kernel's half of the files ranks send from hosts that do not see the repository: written into it.

A rank on an away host (writes/away.py) sends what it wrote for the repository as ``FilePart``
frames on its authenticated channel (writes/outbox.py); the supervisor hands each one to
:meth:`Landing.receive` as it arrives. A file is written piece by piece, as its frames come (one
frame in memory at a time, whatever the file's size), to a hidden ``.NAME.taas-RANK-incoming``
beside its place, and moved into place (``os.replace``) with its last piece: a file is in the
repository whole or not at all, so the completeness check that follows (writes/completeness.py,
after :meth:`close`) names a part that did not arrive, and a half-sent one never passes for whole.

A path is the rank's word, so it is checked before anything is made: relative, without ``..``,
and inside the repository once the folders on its way are resolved (a symbolic link in the
repository that leads out of it is refused). A refused path, a piece out of order and a write
that fails each drop that file, said in one line. Two ranks sending the same path: the last to
finish is the one that stays.

Runs in the kernel, on the run's own thread: :meth:`receive` from the supervisor, :meth:`close` at
the run's clean-up (kernel/runs/run.py), once the ranks are gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from taas_magic.writes.outbox import FilePart


@dataclass
class _Incoming:
    fd: int
    temporary: str
    target: str
    offset: int = 0


@dataclass
class Landing:
    """One run's files from away hosts, written into ``repository`` as they arrive."""

    repository: str
    landed: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # rank -> (path, bytes) moved into place
    problems: list[str] = field(default_factory=list)
    _incoming: dict[tuple[int, str], _Incoming] = field(default_factory=dict)
    _dropped: set[tuple[int, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.repository = os.path.realpath(self.repository)

    def receive(self, rank: int, part: FilePart) -> None:
        """One piece of one of ``rank``'s files: written now; the file moved into place with its last piece."""
        key = (rank, part.path)
        if key in self._dropped:
            return
        try:
            incoming = self._incoming.get(key) or self._begin(rank, part)
            if incoming is None:
                return
            if part.offset != incoming.offset:
                self._drop(key, f"its piece at byte {part.offset} came where byte {incoming.offset} was due")
                return
            view = memoryview(part.data)
            while view:
                view = view[os.write(incoming.fd, view):]
            incoming.offset += len(part.data)
            if part.last:
                fd, incoming.fd = incoming.fd, -1  # closed once, whatever follows: the number may be reused
                os.close(fd)
                os.replace(incoming.temporary, incoming.target)
                del self._incoming[key]
                self.landed.setdefault(rank, []).append((part.path, incoming.offset))
        except OSError as exc:
            self._drop(key, f"it could not be written ({exc.strerror or exc})")

    def _begin(self, rank: int, part: FilePart) -> _Incoming | None:
        key = (rank, part.path)
        target = self.target(part.path)
        if target is None:
            self._drop(key, "that path is outside the repository")
            return None
        if part.offset != 0:
            self._drop(key, "its first piece did not arrive")
            return None
        folder, name = os.path.split(target)
        os.makedirs(folder, exist_ok=True)
        temporary = os.path.join(folder, f".{name}.taas-{rank}-incoming")
        self._incoming[key] = incoming = _Incoming(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                                           0o666), temporary, target)
        return incoming

    def target(self, path: str) -> str | None:
        """Where ``path`` (a rank's, relative to the repository) lands; None when it would land outside it."""
        normal = os.path.normpath(path) if path else "."
        if os.path.isabs(normal) or normal == "." or normal == os.pardir or normal.startswith(os.pardir + os.sep):
            return None
        folder = os.path.realpath(os.path.dirname(os.path.join(self.repository, normal)))  # links on the way, resolved
        if folder != self.repository and not folder.startswith(self.repository + os.sep):
            return None
        return os.path.join(folder, os.path.basename(normal))

    def _drop(self, key: tuple[int, str], why: str) -> None:
        rank, path = key
        self._dropped.add(key)
        incoming = self._incoming.pop(key, None)
        if incoming is not None:
            _discard(incoming)
        self.problems.append(f"taas: rank {rank}'s {path} did not reach the repository: {why}")

    def close(self) -> list[str]:
        """The ranks are gone: what did not arrive whole is removed; the lines to show (what moved, what did not)."""
        for (rank, path), incoming in sorted(self._incoming.items()):
            _discard(incoming)
            self.problems.append(f"taas: rank {rank}'s {path} did not reach the repository whole "
                                 f"({incoming.offset} bytes arrived; the rank ended first)")
        self._incoming.clear()
        return self.summary() + self.problems

    def summary(self) -> list[str]:
        """One line for the files moved into the repository, if any."""
        if not self.landed:
            return []
        files = [entry for rank in sorted(self.landed) for entry in self.landed[rank]]
        ranks = ", ".join(str(rank) for rank in sorted(self.landed))
        return [f"taas: {len(files)} file(s), {_size(sum(length for _, length in files))}, written by rank(s) {ranks} "
                f"on hosts that do not see the repository, sent to it (first: {files[0][0]})"]


def _size(count: int) -> str:
    if count < 1000:
        return f"{count} bytes"
    return f"{count / 1e3:.1f} kB" if count < 1e6 else f"{count / 1e6:.1f} MB"


def _discard(incoming: _Incoming) -> None:
    if incoming.fd >= 0:
        try:
            os.close(incoming.fd)
        except OSError:
            pass
        incoming.fd = -1
    try:
        os.unlink(incoming.temporary)
    except OSError:
        pass

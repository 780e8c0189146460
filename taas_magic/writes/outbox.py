"""In a rank on a host that does not see the notebook's repository: what it wrote for it, sent to the kernel.

Runs in a rank on a host that does not see the repository: entered at its start (rank/startup.py),
sent on its main thread as it ends.

writes/away.py found the host away and gave each of its ranks, rank 0 included, the write rule's
private layer over the repository there, and the notebook's repository (``Placement.away``).
:func:`enter` (rank/startup.py, right after the write rule) takes that: from then on a folder a
collective save names (writes/shared.py) stays in the rank's layer rather than being written in
place on this host, where nobody would read it. As the rank ends, :func:`ship` sends

- from rank 0: every file it wrote under the repository (rank 0's writes are the ones that land);
- from any other rank: the files it wrote under its collective saves' folders (its parts).

They are read from the layer's upper folder (the overlay's, or the Python layer's) and go to the
kernel on the rank's own authenticated channel, in ``FilePart`` frames of at most :data:`CHUNK`
bytes: one piece of one file at a time is in memory (its read, the frame's pickle and the
signed body: about 3 x CHUNK), whatever the files' sizes. The kernel writes them into the
repository (writes/landing.py) before it checks the checkpoints. Not sent: a deletion, a
rename's old name, a symbolic link, a file written outside the repository.

The kernel hears the notebook's paths: :func:`for_kernel` turns the folders a rank names
(``CheckpointSaved``) into the notebook repository's, and :func:`here` the run's folders
(``--shared``, the run's checkpoints) into this host's. Everything runs on the thread that
calls it: the cell's, at its end or with its error report (rank/main.py).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from taas_magic.protocol import ToKernel
from taas_magic.runspec import RunSpec
from taas_magic.wire import Placement
from taas_magic.writes import shared, unseen
from taas_magic.writes.savers import CheckpointSaved


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class FilePart(ToKernel, kind="file-part"):
    """Bytes ``offset``.. of a file an away rank wrote (writes/outbox.py), for the repository (writes/landing.py)."""

    path: str  # relative to the repository
    offset: int
    data: bytes  # at most outbox.CHUNK: a file never sits whole in memory on either side
    last: bool  # the file is whole: the kernel moves it into place


CHUNK = 1 << 20  # bytes of a file per frame

Send = Callable[[ToKernel], None]


@dataclass(frozen=True)
class _Away:
    repository: str  # this rank's repository on this host
    notebook: str  # the notebook's repository, on the kernel's host
    upper: str  # where the write rule put what the rank wrote under the repository
    everything: bool  # rank 0: every file it wrote is the repository's


_away: _Away | None = None
_shipped = False


def enter(place: Placement) -> None:
    """Rank start-up, after the write rule: a placement with ``away`` makes this rank's writes sent, not left here."""
    global _away
    if place.away is None or place.repository is None or place.layer is None:
        return
    # only ranks carry the run's marker, and rank r is peer r on the wire (peers.py): peer 0 is rank 0
    _away = _Away(os.path.realpath(place.repository), place.away, os.path.join(place.layer, "upper"), place.peer_id == 0)
    shared.hold_in_layer()
    unseen.enter(_away.repository, _away.upper)  # the repository's files this host lacks: named, not readable


def _move(path: str, source: str, target: str) -> str:
    """``path`` under ``source``, the same place under ``target``; any other path as it is."""
    if path == source or path.startswith(source + os.sep):
        return os.path.join(target, os.path.relpath(path, source)) if path != source else target
    return path


def away() -> bool:
    """Whether this rank runs on a host that does not see the notebook's repository."""
    return _away is not None


def here(spec: RunSpec) -> RunSpec:
    """The run's folders in the repository (``--shared``, the run's checkpoints), as this host holds them."""
    if _away is None:
        return spec
    notebook, repository = _away.notebook, _away.repository
    return dataclasses.replace(spec, shared=tuple(_move(folder, notebook, repository) for folder in spec.shared),
                               checkpoints=_move(spec.checkpoints, notebook, repository) if spec.checkpoints else "")


def for_kernel(send: Send) -> Send:
    """``send``, with each ``CheckpointSaved`` folder named as the notebook's repository holds it."""
    if _away is None:
        return send
    away = _away

    def send_notebook_paths(frame: ToKernel) -> None:
        if isinstance(frame, CheckpointSaved):
            frame = dataclasses.replace(frame, folder=_move(frame.folder, away.repository, away.notebook))
        send(frame)

    return send_notebook_paths


def ship(send: Send) -> None:
    """Send what this rank wrote for the repository (rank 0: everything; another: its collective saves'
    folders), once; a file that cannot be read is named on stderr, and the rest still go."""
    global _shipped
    if _away is None or _shipped:
        return
    _shipped = True
    for relative in files(_away.upper, (".",) if _away.everything else shared.shared()):
        if unseen.placeholder(relative):
            continue  # the notebook's own file, named here only
        try:
            send_file(send, _away.upper, relative)
        except ConnectionError:
            return  # the kernel is gone, or stopping this rank: nobody to send to
        except OSError as exc:
            print(f"taas: {relative} could not be sent to the notebook's repository ({exc})", file=sys.stderr, flush=True)


def files(upper: str, folders: tuple[str, ...]) -> Iterator[str]:
    """The regular files under ``folders`` (relative) of ``upper``, relative to it, each once."""
    seen: set[str] = set()
    for folder in folders:
        for directory, subdirs, names in os.walk(os.path.join(upper, folder)):
            subdirs.sort()
            for name in sorted(names):
                relative = os.path.normpath(os.path.relpath(os.path.join(directory, name), upper))
                if relative not in seen and stat.S_ISREG(os.lstat(os.path.join(upper, relative)).st_mode):
                    seen.add(relative)
                    yield relative


def send_file(send: Send, upper: str, relative: str) -> None:
    """One file, in frames of at most :data:`CHUNK` bytes (one frame for an empty file)."""
    with open(os.path.join(upper, relative), "rb") as file:
        size, offset = os.fstat(file.fileno()).st_size, 0
        while True:
            data = file.read(CHUNK)
            last = not data or offset + len(data) >= size
            send(FilePart(relative, offset, data, last))
            offset += len(data)
            if last:
                return

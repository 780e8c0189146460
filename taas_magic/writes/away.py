"""Does a host see the notebook's repository? The run's marker, and where ranks write on a host that does not.

Runs in the kernel (the run's marker, written in its plan step) and in a Ray host agent or Slurm
task (:func:`settle`: does this host see the repository, and where its ranks write).

On a cluster the ranks of other hosts are told the notebook's repository by its path. Where that
path is the same folder on every host (a shared filesystem: NFS, Lustre, a home mounted
everywhere), a rank writes there in place, as on one host. Where it is not (a node's own disk
holding a copy, or nothing, at that path), what the rank writes there would stay on its node.
Which of the two a host is cannot be told from the path, so the kernel asks the filesystem:

- **The kernel** (:class:`Marker`, on the run's thread), before a cluster run starts, writes the
  file ``.taas/here-<kernel pid>-<128 random bits>@<host>`` in the repository, holding its own name, and
  removes it when the run ends (a killed kernel's are swept by the next). Each rank's placement
  (``wire.Placement.marker``) names it. A repository the kernel cannot write gets no marker, and
  every host is taken to see it (as before: nothing changes).
- **A host's agent** (:func:`settle`: a Ray actor, or a Slurm task; before it starts its ranks)
  reads that file at the repository's path. Seen, with its name inside: the host sees the
  repository, and nothing changes. Not seen: the host is *away*. The name is new to every host, so
  no cache (NFS's attribute and lookup caches included) can show it where the folder is not the
  same; a host that misses it only because its cache is slow is taken for away, which costs a
  transfer and never loses a file.

On an away host every rank, rank 0 included, gets the write rule's private layer (its changes land
there, never in the node's folder), and ``away`` in its placement: the notebook's repository.
Its repository there is the folder at the same path when the host has one (a node's own copy:
reads and absolute paths find it), else an empty stand-in made here, the rank's working folder at
the same place in it as the notebook's in the repository. What must reach the repository (every
file rank 0 wrote; a collective checkpoint's parts from the others) is sent to the kernel as the
rank ends (writes/outbox.py), and written into the repository by the kernel (writes/landing.py).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import tempfile
from dataclasses import dataclass

from taas_magic.procs import pid_alive
from taas_magic.wire import Placement

FOLDER = ".taas"  # taas's own folder in the repository (the run checkpoints' too)
PREFIX = "here-"
AWAY_PREFIX = "taas-away-"
_HOST = socket.gethostname().replace(os.sep, "_")  # a marker names its kernel's host: a kernel sweeps only its host's


class Marker:
    """The kernel's marker of one cluster run in ``repository``; :attr:`name` is None where it could not be written."""

    def __init__(self, repository: str):
        self.repository = repository
        self.name: str | None = os.path.join(FOLDER, f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}@{_HOST}")
        folder = os.path.join(repository, FOLDER)
        try:
            os.makedirs(folder, exist_ok=True)
            _sweep(folder)
            with open(os.path.join(repository, self.name), "x") as file:
                file.write(self.name)
        except OSError:
            self.name = None  # a repository the kernel cannot write: every host is taken to see it

    def remove(self) -> None:
        if self.name is not None:
            try:
                os.unlink(os.path.join(self.repository, self.name))
            except FileNotFoundError:
                pass


def _marker_pid(name: str) -> int | None:
    """The pid of the kernel that wrote the marker named ``name`` (:class:`Marker`), or None: not a marker's name."""
    pid = name[len(PREFIX):].split("-", 1)[0]
    return int(pid) if name.startswith(PREFIX) and pid.isdigit() else None


def _sweep(folder: str) -> None:
    """This host's markers whose kernel is gone (it was killed before it removed them)."""
    for name in os.listdir(folder):
        pid = _marker_pid(name)
        if pid is not None and name.endswith(f"@{_HOST}") and not pid_alive(pid):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def sees(repository: str, marker: str) -> bool:
    """Whether this host sees the run's ``marker`` (its name inside) at the ``repository``'s path."""
    try:
        with open(os.path.join(repository, marker)) as file:
            return file.read() == marker
    except (OSError, UnicodeDecodeError):
        return False


@dataclass(frozen=True)
class AwayHost:
    """Where the ranks of a host that does not see the repository write: all of it under :attr:`root`."""

    root: str  # made here, owner-only; the host's agent removes it
    repository: str  # the ranks' repository here: the host's own folder at the path, or a stand-in in root
    notebook: str  # the notebook's repository, for which their files are sent
    cwd: str  # the ranks' working folder here

    def place(self, place: Placement) -> Placement:
        """A rank's placement on this host: its repository here, a private layer (rank 0 too), ``away``."""
        layer = os.path.join(self.root, f"layer-{place.peer_id}")
        os.makedirs(layer, mode=0o700, exist_ok=True)
        return dataclasses.replace(place, repository=self.repository, layer=layer, away=self.notebook)


def settle(places: list[Placement], cwd: str) -> AwayHost | None:
    """None when this host sees the run's repository (or the run has no marker); else where its
    ranks write instead (made now). ``cwd``: the notebook's working folder. Runs on the agent's thread."""
    marked = next((place for place in places if place.marker and place.repository), None)
    if marked is None or marked.repository is None or marked.marker is None or sees(marked.repository, marked.marker):
        return None
    notebook = marked.repository
    kernel = _marker_pid(os.path.basename(marked.marker))  # whose run: its kernel's pid names the host's folder
    root = tempfile.mkdtemp(prefix=f"{AWAY_PREFIX}{kernel if kernel is not None else 0}-")
    # the host's own folder at that path (a copy of the repository, or not), else a stand-in
    here = notebook if os.path.isdir(notebook) else os.path.join(root, "repository")
    os.makedirs(here, mode=0o700, exist_ok=True)
    if cwd != notebook and not cwd.startswith(notebook + os.sep):  # the notebook works outside its repository
        return AwayHost(root, here, notebook, cwd if os.path.isdir(cwd) else tempfile.gettempdir())
    work = os.path.join(here, os.path.relpath(cwd, notebook))
    if here != notebook:
        os.makedirs(work, mode=0o700, exist_ok=True)
    return AwayHost(root, here, notebook, os.path.normpath(work) if os.path.isdir(work) else here)

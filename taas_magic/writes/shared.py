"""In a rank other than 0: a directory of the repository written in place, through the write rule.

The write rule gives a rank other than 0 a private layer over the repository (namespace.py's
overlay, or divert.py's Python layer). A collective checkpoint needs the opposite for its own
folder: every rank writes its own part there (DCP's ``__1_0.distcp``, accelerate's
``random_states_1.pkl``), and a part left in a layer is a checkpoint nobody can load.
:func:`share` makes one directory of the repository written in place by this process and
everything it starts; every other path stays diverted.

- **Overlay.** Before the overlay is mounted, :func:`keep_repository` keeps a ``O_PATH`` descriptor
  of the repository itself (the directory under the mount). Sharing ``ckpt/step3`` makes the
  directory there (``/proc/self/fd/N/ckpt/step3``) and bind-mounts it over the same path of the
  overlay, in the rank's own mount namespace: every write below it, by Python, C++ or a
  subprocess (DCP's process executor), reaches the repository; the host's mounts are untouched.
- **Python.** The layer passes paths under a shared directory through (writes/layer.py).
- **Rank 0, and processes without the rule.** Nothing to do: they write in place already.
- **A host that does not see the repository** (writes/away.py): the folder is only recorded, and
  stays in the rank's layer, from where writes/outbox.py sends it to the kernel.

A deletion under a shared directory acts on the repository too, so rotating checkpoints is
rank 0's job, as torchtitan, accelerate, the HF Trainer and Lightning do it.

Runs in each rank, on whichever thread makes the save (a mount is per process); :data:`lock`
serialises it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

from taas_magic.writes.layer import Layer, inside, inside_any

MS_BIND = 0x1000
MS_REC = 0x4000

lock = threading.RLock()  # share() and a refresh of the view (writes/refresh.py) are one at a time
_repository: str | None = None  # the repository, where this process's writes are diverted
_real: int | None = None  # overlay: an O_PATH descriptor of the repository below the mount
_layer: Layer | None = None  # python: the divert.py Layer
_shared: list[str] = []  # the relative directories shared so far, in order
_held = False  # a rank on a host that does not see the repository: shared folders stay in its layer


class ShareRefused(OSError):
    """The directory cannot be written in place (outside the repository, or the bind mount was refused)."""


def keep_repository(repository: str) -> None:
    """Overlay, before its mount: keep a way to the repository below it (namespace.py calls this)."""
    global _repository, _real
    _repository = os.path.realpath(repository)
    _real = os.open(_repository, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def forget_repository() -> None:
    """The overlay was refused after :func:`keep_repository`: the Python fallback takes over."""
    global _repository, _real
    if _real is not None:
        os.close(_real)
    _repository = _real = None


def repository() -> str | None:
    """The repository this process diverts (None: it diverts nothing)."""
    return _repository


def repository_below() -> str:
    """Overlay: a path to the repository itself, below the mount (:func:`keep_repository` kept it)."""
    assert _real is not None, "keep_repository first"
    return f"/proc/self/fd/{_real}"


def bind_all(root: str) -> None:
    """Overlay: every folder shared so far that is still there bound again under ``root``, a new view of the
    repository (writes/refresh.py makes one ready for each refresh, and binds them as it takes its place)."""
    with lock:
        if _real is None or _held:
            return
        # IMPORTANT: a folder rank 0 removed since (rotating old checkpoints) is not made again: it is forgotten,
        # and a save into it later shares it anew.
        _shared[:] = [rel for rel in _shared if os.path.isdir(os.path.join(repository_below(), rel))]
        for rel in _shared:
            _bind(rel, root)


def use_layer(repository: str, layer: Layer) -> None:
    """Python fallback: shared directories pass through ``layer`` (divert.py calls this)."""
    global _repository, _layer
    _repository, _layer = os.path.realpath(repository), layer


def diverted() -> bool:
    """Whether this process's writes under the repository are diverted (a rank other than 0, a data worker)."""
    return _repository is not None


def relative(path: str | os.PathLike) -> str | None:
    """``path`` relative to the repository this process diverts, or None when it diverts nothing or
    ``path`` is outside it (an absolute path is compared after ``abspath``, as the layer does)."""
    if _repository is None:
        return None
    full = os.path.abspath(os.fsdecode(os.fspath(path)))
    if not inside(full, _repository):
        return None
    return os.path.relpath(full, _repository)


def is_shared(rel: str) -> bool:
    return inside_any(rel, _shared)


def share(path: str | os.PathLike) -> bool:
    """Let this process write ``path`` (a directory, made if missing) in place; True when it was diverted
    before. Idempotent; a directory under one already shared costs nothing.

    Raises:
        ShareRefused: the bind mount was refused (the message says why).
    """
    rel = relative(path)
    if rel is None:
        return False
    with lock:
        if is_shared(rel):
            return True
        if _held:  # a rank on an away host: the folder stays in its layer, sent as the rank ends (writes/outbox.py)
            _shared.append(rel)
            return True
        if _real is not None:
            _bind(rel)
        elif _layer is not None:
            # IMPORTANT: in the repository itself, with the layer's unpatched mkdir: os.makedirs is diverted
            # here, and would make the folder in the layer, where rank 1's parts then wait for rank 0 to make it.
            _makedirs(os.path.join(_repository or "", rel), _layer.real_mkdir)
        _shared.append(rel)
        if _layer is not None:
            _layer.shared = tuple(_shared)
    return True


def hold_in_layer() -> None:
    """A rank on a host that does not see the notebook's repository (writes/outbox.py): a shared folder
    is only recorded; it stays in the rank's layer, from where it is sent to the kernel."""
    global _held
    _held = True


def shared() -> tuple[str, ...]:
    """The directories shared so far, relative to the repository."""
    return tuple(_shared)


def _makedirs(path: str, mkdir: Callable[[str], None]) -> None:
    """``os.makedirs(path, exist_ok=True)`` with ``mkdir`` alone (no ``stat``: it is diverted): another
    rank making the same folders at the same moment is no error."""
    try:
        mkdir(path)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        _makedirs(parent, mkdir)
        try:
            mkdir(path)
        except FileExistsError:
            pass


def _bind(rel: str, root: str | None = None) -> None:
    """Bind the repository's own ``rel`` over ``rel`` of the view at ``root`` (the repository's path: the view in use)."""
    assert _repository is not None and _real is not None
    below = os.path.join(repository_below(), rel) if rel != "." else repository_below()
    view = os.path.join(root or _repository, rel)
    try:
        os.makedirs(below, exist_ok=True)  # in the repository itself
        os.makedirs(view, exist_ok=True)  # the mount point, in the overlay (there already, through the lower layer)
    except OSError as exc:
        raise ShareRefused(exc.errno, f"could not make {rel} to write it in place: {exc.strerror}") from exc
    libc = ctypes.CDLL(None, use_errno=True)
    # MS_REC: a plain bind of a tree holding mounts this namespace may not reveal is refused.
    if libc.mount(below.encode(), view.encode(), None, MS_BIND | MS_REC, None) != 0:
        errno = ctypes.get_errno()
        raise ShareRefused(errno, f"could not bind {rel} of the repository in place: {os.strerror(errno)}")

"""``taas.save_checkpoint`` / ``taas.load_checkpoint``: what a restarted run resumes from.

Runs in each rank, on the cell's thread (``taas.save_checkpoint`` / ``taas.load_checkpoint``), and
in the kernel, on the cell's thread, where the notebook loads the last run's newest checkpoint.

A run's checkpoints live in one folder, ``<root>/<run id>/checkpoint-000001.pt``, ... where
the root is ``TaasMagics.checkpoint_dir`` or, by default, ``<repository>/.taas/checkpoints``
(rank 0 may write in the repository; the folder holds a ``.gitignore`` of ``*`` so git
leaves it alone). Every rank may call :func:`save`; only rank 0's lands. It is written
as torch.save writes it, to a temporary file in the same folder, flushed to disk
(``fsync``), then renamed over its final name and the folder synced: a rank killed in the
middle of a save leaves the previous checkpoint whole and a temporary file that nothing
reads. The newest ``TaasMagics.keep_checkpoints`` of a run are kept; other runs' folders
are never touched (remove ``.taas/checkpoints`` yourself when you no longer want them).

:func:`load` returns the newest checkpoint rank 0 saved in this run (None before the
first), mapped to the rank's own device; in the notebook, after the cell, the newest of
the kernel's last run. The cluster mode needs the root on a file system every host sees,
as Ray Train's ``storage_path`` does.

Which folder is "this run's" is a rank's process state, set once by its bootstrap from the
run spec (:func:`use_run`, rank/main.py). In the kernel the last run's folder is the
session's (kernel/runs/summary.py's LastRun), given to :func:`load` and :func:`newest` by the face.
Nothing is read from the environment, so a process the cell starts (which inherits it) never
writes into the run's folder by mistake.
"""

from __future__ import annotations

import os
import re
from typing import Any

PREFIX, SUFFIX = "checkpoint-", ".pt"
_NAME = re.compile(rf"^{PREFIX}(\d+)({re.escape(SUFFIX)})?$")  # a file, or a sharded checkpoint's folder
DCP_MARKER = ".metadata"  # DCP writes it last, through a rename: a folder without it is not whole

DEFAULT_KEEP = 2

_run_folder: str | None = None  # in a rank: its run's folder (None elsewhere)
_keep = DEFAULT_KEEP  # in a rank: how many of its run's newest checkpoints are kept


def use_run(folder: str, keep: int) -> None:
    """A rank, from its run spec: :func:`save` and :func:`load` use this folder, keeping ``keep``."""
    global _run_folder, _keep
    _run_folder, _keep = folder or None, keep


def run_folder() -> str | None:
    """This run's folder, in a rank (None elsewhere: the kernel's is the session's last run's)."""
    return _run_folder


def kept() -> int:
    """How many checkpoints this rank's run keeps."""
    return _keep


def _numbered(folder: str, whole: bool = True) -> list[tuple[int, str]]:
    """The folder's checkpoints by number: files, and sharded folders (only those whose save finished,
    unless ``whole`` is False)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        path = os.path.join(folder, name)
        if match.group(2) is None and whole and not os.path.exists(os.path.join(path, DCP_MARKER)):
            continue  # a sharded save that did not finish (a rank killed mid-save): never resumed from
        found.append((int(match.group(1)), path))
    return sorted(found)


def newest(folder: str | None) -> str | None:
    """The path of the folder's newest whole checkpoint (a file, or a sharded checkpoint's folder), or None."""
    found = _numbered(folder) if folder else []
    return found[-1][1] if found else None


def is_sharded(path: str) -> bool:
    """Whether a checkpoint :func:`newest` named is a sharded (DCP) one: a folder."""
    return os.path.isdir(path)


def next_path(folder: str, sharded: bool) -> str:
    """Where the folder's next checkpoint goes (a file, or a folder for a sharded save); the folder is made,
    owner-only, with a ``.gitignore`` of ``*``."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    ignore = os.path.join(folder, ".gitignore")
    if not os.path.exists(ignore):
        with open(ignore, "w") as file:
            file.write("*\n")
    found = _numbered(folder, whole=False)
    return os.path.join(folder, f"{PREFIX}{(found[-1][0] + 1 if found else 1):06d}{'' if sharded else SUFFIX}")


def rotate(folder: str, keep: int) -> None:
    """After a save: keep the newest ``keep`` whole checkpoints, remove the older ones and every sharded save
    that did not finish (saves of a run are one after another, so none is under way)."""
    import shutil

    kept = {path for _, path in _numbered(folder)[-keep:]}
    for _, path in _numbered(folder, whole=False):
        if path in kept:
            continue
        if is_sharded(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _remove(path)


def save(obj: Any, folder: str, keep: int) -> str:
    """Write ``obj`` atomically as the folder's next checkpoint; keep the newest ``keep``. Returns its path."""
    import torch

    final = next_path(folder, sharded=False)
    temporary = os.path.join(folder, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    _sync_folder(folder)
    rotate(folder, keep)
    for name in os.listdir(folder):  # what a rank killed mid-save left
        if name.startswith(".") and ".tmp-" in name and not name.endswith(f".tmp-{os.getpid()}"):
            _remove(os.path.join(folder, name))
    return final


def _sync_folder(folder: str) -> None:
    """The rename itself reaches the disk (a crash now cannot bring the old name back)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def load(folder: str | None, map_location: Any, into: Any = None) -> Any:
    """The newest checkpoint in ``folder`` (None if there is none), tensors on ``map_location``.

    A sharded checkpoint (DCP's folder) is loaded into ``into`` (your state dict, sharded as you
    want it: ``dcp.load`` reshards) and ``into`` is returned; without ``into``, outside a process
    group (the notebook), it comes back whole, as one state dict on the CPU.

    Raises:
        ValueError: a sharded checkpoint, no ``into``, inside a process group.
    """
    path = newest(folder)
    if path is None:
        return None
    import torch

    if is_sharded(path):
        return _load_sharded(path, into)

    # weights_only=False: a checkpoint is any object the cell saved (a model, an optimizer, a
    # dataclass), and this file is the run's own, written by its rank 0 into an owner-only folder.
    return torch.load(path, map_location=map_location, weights_only=False)


def _load_sharded(path: str, into: Any) -> Any:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    grouped = dist.is_available() and dist.is_initialized()
    if into is not None:
        dcp.load(into, checkpoint_id=path, no_dist=not grouped)  # the notebook: no process group, no warning
        return into
    if grouped:
        raise ValueError(f"{path} is a sharded checkpoint: every rank loads its part into its own state, "
                         "taas.load_checkpoint(into=state)")
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="taas-whole-") as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(path, whole)
        # weights_only=False: as load's; the folder is the run's own.
        return torch.load(whole, map_location="cpu", weights_only=False)


def save_sharded(state: Any, folder: str, keep: int) -> str:
    """Every rank, together: ``state`` (DTensors, or objects whose ``state_dict`` holds them) saved with DCP as
    the folder's next checkpoint, each rank writing its own part (writes/savers.py shares the folder); rank 0
    then keeps the newest ``keep``. Returns the checkpoint's folder on every rank.

    Raises:
        RuntimeError: no process group (a sharded save is a collective).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a sharded checkpoint is saved by every rank together: call taas.save_checkpoint "
                           "on every rank after init_process_group")
    chosen = [next_path(folder, sharded=True) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)  # one number for every rank, whatever each one lists
    path = chosen[0]
    assert isinstance(path, str)
    dcp.save(state, checkpoint_id=path)  # returns once the coordinator wrote .metadata: every part is there
    if dist.get_rank() == 0:
        rotate(folder, keep)
    return path

"""``taas.save_checkpoint`` / ``taas.load_checkpoint``: what a restarted run resumes from.

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
_NAME = re.compile(rf"^{PREFIX}(\d+){re.escape(SUFFIX)}$")

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


def _numbered(folder: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [(int(match.group(1)), os.path.join(folder, name)) for name in names if (match := _NAME.match(name))]
    return sorted(found)


def newest(folder: str | None) -> str | None:
    """The path of the folder's newest whole checkpoint, or None."""
    found = _numbered(folder) if folder else []
    return found[-1][1] if found else None


def save(obj: Any, folder: str, keep: int) -> str:
    """Write ``obj`` atomically as the folder's next checkpoint; keep the newest ``keep``. Returns its path."""
    import torch

    os.makedirs(folder, mode=0o700, exist_ok=True)
    ignore = os.path.join(folder, ".gitignore")
    if not os.path.exists(ignore):
        with open(ignore, "w") as file:
            file.write("*\n")
    found = _numbered(folder)
    final = os.path.join(folder, f"{PREFIX}{(found[-1][0] + 1 if found else 1):06d}{SUFFIX}")
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
    for _, old in (found + [(0, final)])[:-keep]:
        _remove(old)
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


def load(folder: str | None, map_location: Any) -> Any:
    """The newest checkpoint in ``folder`` (None if there is none), tensors on ``map_location``."""
    path = newest(folder)
    if path is None:
        return None
    import torch

    # weights_only=False: a checkpoint is any object the cell saved (a model, an optimizer, a
    # dataclass), and this file is the run's own, written by its rank 0 into an owner-only folder.
    return torch.load(path, map_location=map_location, weights_only=False)

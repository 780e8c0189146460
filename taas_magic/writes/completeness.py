"""Is a DCP checkpoint whole? Its ``.metadata`` against its files, read without running its pickle.

Runs in the kernel, on the run's own thread: the ledger as the ranks name their saves, the check as
the run releases its layers.

``torch.distributed.checkpoint`` writes each rank's part (``__{rank}_{n}.distcp``) in place, then
the coordinator writes ``.metadata`` (through ``.metadata.tmp`` and a rename), which lists every
part's bytes (``storage_data``: relative path, offset, length): it is the only completion
marker. :func:`check_dcp` says what is wrong with a folder, in words a person can act on:

- no ``.metadata``: the save did not finish (a rank killed mid-save, a save still running); the
  parts that are there, and the ranks that have none;
- a part ``.metadata`` lists that is missing or shorter than listed, with the rank it belonged to
  (DCP names a rank's parts ``__{rank}_``; another writer's names give no rank).

``.metadata`` is a pickle. It is read by :class:`_InertUnpickler`, which builds inert stand-ins
for the few classes a DCP pickle names (from ``torch`` and ``pathlib``) and refuses any other
global, so reading it never runs code and never imports torch: the kernel checks a folder the
run's ranks wrote without trusting what is in it.

:class:`Ledger` is the kernel's half: the folders the ranks named during a run
(``CheckpointSaved`` frames, writes/savers.py), checked once the ranks are gone
(kernel/runs/run.py). Pure functions of the folder; runs on the run's thread.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

from taas_magic.writes.savers import CheckpointSaved

METADATA = ".metadata"
_RANK_PART = re.compile(r"^__(\d+)_\d+")
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
_ALLOWED = ("torch", "pathlib")  # the modules (and their submodules) a DCP .metadata names


class _Inert:
    """A stand-in for a class a DCP pickle names: keeps what it was built from, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.state = args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        state = self.state[1] if isinstance(self.state, tuple) and len(self.state) == 2 else self.state
        if isinstance(state, dict):
            return state.get(name)
        return getattr(state, name, None)


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] not in _ALLOWED:
            raise pickle.UnpicklingError(f"names {module}.{name}, which a DCP .metadata does not")
        return type(name, (_Inert,), {"__module__": "taas_magic.writes.completeness.inert"})


def read_parts(path: str) -> dict[str, int]:
    """The parts a ``.metadata`` file lists: relative path -> the bytes it must hold at least.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a DCP metadata pickle.
    """
    with open(path, "rb") as file:
        try:
            metadata = _InertUnpickler(file).load()
        except Exception as exc:
            raise ValueError(f"not a DCP .metadata ({type(exc).__name__}: {exc})") from exc
    storage = metadata.field("storage_data") if isinstance(metadata, _Inert) else None
    if not isinstance(storage, dict):
        raise ValueError("not a DCP .metadata (no storage_data)")
    parts: dict[str, int] = {}
    for info in storage.values():
        if not isinstance(info, _Inert):
            raise ValueError("not a DCP .metadata (a part without its place)")
        relative, offset, length = info.field("relative_path"), info.field("offset"), info.field("length")
        if not isinstance(relative, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise ValueError("not a DCP .metadata (a part without its place)")
        parts[relative] = max(parts.get(relative, 0), offset + length)
    return parts


def owner(name: str) -> int | None:
    """The rank whose part a DCP file is, by DCP's own naming (``__{rank}_{n}``); None for other names."""
    match = _RANK_PART.match(os.path.basename(name))
    return int(match.group(1)) if match else None


def _whose(name: str) -> str:
    rank = owner(name)
    return f"{name} (rank {rank})" if rank is not None else name


def check_dcp(folder: str, world_size: int) -> str | None:
    """What is wrong with the DCP checkpoint in ``folder``, in one phrase; None when it is whole
    (or gone: a folder rotated away by rank 0 is not incomplete)."""
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"could not be read ({exc.strerror})"
    metadata = [name for name in names if name == METADATA or _RANK_METADATA.match(name)]
    if not metadata:
        parts = [name for name in names if owner(name) is not None and not name.endswith(".tmp")]
        ranks = {owner(name) for name in parts}
        lacking = [str(rank) for rank in range(world_size) if rank not in ranks]
        there = "; ".join(_whose(name) for name in parts) or "none"
        return (f"no {METADATA}: the save did not finish (parts there: {there}"
                + (f"; none of rank {', '.join(lacking)})" if lacking else ")"))
    missing, short = [], []
    for name in metadata:
        try:
            listed = read_parts(os.path.join(folder, name))
        except (OSError, ValueError) as exc:
            return f"its {name} could not be read: {exc}"
        for relative, size in sorted(listed.items()):
            try:
                actual = os.stat(os.path.join(folder, relative)).st_size
            except FileNotFoundError:
                missing.append(_whose(relative))
                continue
            if actual < size:
                short.append(f"{_whose(relative)}, {actual} of {size} bytes")
    problems = []
    if missing:
        problems.append(f"{METADATA} lists {', '.join(missing)}, missing")
    if short:
        problems.append(f"shorter than {METADATA} says: {'; '.join(short)}")
    return "; ".join(problems) or None


@dataclass
class Ledger:
    """The kernel's record of one run's collective saves: each folder the ranks named, checked at the end."""

    folders: dict[str, CheckpointSaved] = field(default_factory=dict)
    ranks: dict[str, set[int]] = field(default_factory=dict)

    def saw(self, rank: int, frame: CheckpointSaved) -> None:
        self.folders.setdefault(frame.folder, frame)
        self.ranks.setdefault(frame.folder, set()).add(rank)

    def report(self, repository: str, world_size: int) -> list[str]:
        """One line per DCP checkpoint of the run that is not whole (none when every one is)."""
        lines = []
        for folder, frame in self.folders.items():
            if frame.layout != "dcp":
                continue
            problem = check_dcp(folder, world_size)
            if problem is not None:
                shown = os.path.relpath(folder, repository) if folder.startswith(repository + os.sep) else folder
                lines.append(f"taas: checkpoint {shown} is incomplete: {problem}")
        return lines

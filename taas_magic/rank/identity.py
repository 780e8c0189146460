"""Whether this process is a rank, and the rank's device, seed and report: what ``import taas`` answers by.

Runs wherever ``import taas`` is: in each rank (set on its main thread by rank/main.py, read on any
thread of its cell), in the kernel (the notebook's defaults; its checkpoint calls on the cell's
thread) and in a data worker (the defaults).

The rank bootstrap (rank/main.py) calls :func:`enter` before the cell runs; anywhere else (the
notebook, a data worker, a subprocess the cell starts, which inherits the rank's environment
but is not a rank) the defaults hold: not a rank, the CPU, seed 0, reports ignored. The state
lives here and only here: the face (taas.py) reads it at each call, so the cell's ``import taas``
sees what the bootstrap set, whichever was imported first.

The calls of the face that answer by it are here too: :func:`get_worker_info`, the checkpoints
(:func:`save_checkpoint`, :func:`load_checkpoint`, :func:`checkpoint_path`, over
taas_magic/writes/checkpoints.py) and :func:`lightning_logger`; ``taas.report`` calls :data:`reporter`.
This module imports nothing heavy: torch only inside a rank's calls, where it is loaded.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def ignore(step: Any = None, **metrics: Any) -> None:
    """``taas.report`` outside a rank: there is no chart to draw in, so nothing to do."""


_in_rank = False
_device = "cpu"  # in a rank: "cuda" when it has its own GPU
_seed = 0  # in a rank: the run's seed, from the run spec
reporter: Callable[..., None] = ignore  # what taas.report calls; in a rank, output/reports.py's report


def enter(device: str, seed: int, report: Callable[..., None]) -> None:
    """The rank bootstrap, before the cell runs: this process is a rank on ``device`` ("cuda" or
    "cpu") with the run's ``seed``, and ``taas.report`` calls ``report``."""
    global _in_rank, _device, _seed, reporter
    _in_rank, _device, _seed, reporter = True, device, seed, report


def in_rank() -> bool:
    """True inside a process that taas started to run a cell as one rank."""
    return _in_rank


def get_worker_info() -> Any:
    """Inside a rank, torch's ``WorkerInfo(id=RANK, num_workers=WORLD_SIZE, seed=run seed + RANK)``; else ``None``."""
    if not _in_rank:
        return None
    from torch.utils.data._utils.worker import WorkerInfo  # private API: see taas_magic/private.py

    rank = int(os.environ["RANK"])
    return WorkerInfo(
        id=rank,
        num_workers=int(os.environ["WORLD_SIZE"]),
        seed=_seed + rank,
        dataset=None,  # type: ignore[arg-type]  # a rank has no dataset of its own
    )


def save_checkpoint(obj: Any, sharded: bool | None = None) -> str | None:
    """``taas.save_checkpoint``: rank 0 saves ``obj`` as the run's newest checkpoint and returns its path;
    the other ranks return None. A sharded ``obj`` (``sharded``, or None: it holds DTensors) is saved by
    every rank together with DCP, each writing its part, and every rank returns the folder.

    Raises:
        RuntimeError: outside a taas cell (use ``torch.save`` there); a sharded save without a process group.
    """
    if not _in_rank:
        raise RuntimeError("taas.save_checkpoint works inside a taas cell; in the notebook, use torch.save")
    from taas_magic.writes import checkpoints

    folder = checkpoints.run_folder()
    assert folder is not None  # the kernel names it in every rank's spec
    if sharded if sharded is not None else holds_dtensors(obj):
        return checkpoints.save_sharded(obj, folder, checkpoints.kept())
    if os.environ.get("RANK") != "0":
        return None
    return checkpoints.save(obj, folder, checkpoints.kept())


def holds_dtensors(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` (a state dict, nested dicts and lists, modules and optimizers in them) holds a DTensor."""
    import sys

    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None or depth > 8:
        return False  # nothing made a DTensor without importing their module
    if isinstance(obj, tensor.DTensor):
        return True
    if isinstance(obj, dict):
        return any(holds_dtensors(value, depth + 1) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_dtensors(value, depth + 1) for value in obj)
    parameters = getattr(obj, "parameters", None)
    if callable(parameters):  # a module
        return any(isinstance(parameter, tensor.DTensor) for parameter in parameters())
    return False


def load_checkpoint(map_location: Any = None, notebook_folder: str | None = None, into: Any = None) -> Any:
    """``taas.load_checkpoint``: the run's newest checkpoint (None before the first), on the rank's own
    device in a rank and on the CPU in the notebook, unless ``map_location`` says otherwise; a sharded one
    is loaded into ``into``. Outside a rank the folder is ``notebook_folder`` (the session's last run's,
    which the face reads)."""
    from taas_magic.writes import checkpoints

    if map_location is None:
        map_location = own_device() if _in_rank else "cpu"
    return checkpoints.load(checkpoints.run_folder() if _in_rank else notebook_folder, map_location, into)


def checkpoint_path(notebook_folder: str | None = None) -> str | None:
    """``taas.checkpoint_path``: the file :func:`load_checkpoint` would read now."""
    from taas_magic.writes import checkpoints

    return checkpoints.newest(checkpoints.run_folder() if _in_rank else notebook_folder)


def shared(path: Any) -> str:
    """``taas.shared``: in a rank, ``path`` is written in place by this rank from now on (writes/savers.py)."""
    if not _in_rank:
        return os.path.abspath(os.fsdecode(os.fspath(path)))
    from taas_magic.writes import savers

    return savers.share(path, "taas.shared")


def own_device() -> Any:
    """The rank's torch device: its own GPU (the current one) when it has one, else the CPU."""
    import torch

    if _device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lightning_logger() -> Any:
    """``taas.lightning_logger``: a Lightning logger whose metrics go where ``taas.report``'s go now."""
    from taas_magic.rank import lightning

    return lightning.logger(reporter)

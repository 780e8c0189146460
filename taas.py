"""``import taas``: the notebook-side API of taas_magic.

An API-compatible, open replacement for the hosted platform's client of the same
name (the two packages both provide a top-level ``taas`` module and cannot be
installed side by side). This module imports nothing heavy: torch is imported only
by :func:`get_worker_info`, inside a rank, where it is already loaded.

- :func:`register` / :func:`unregister` / :func:`registered`: the DataLoaders that
  taas data workers prepare for the ranks (``--cpus``/``--units``).
- :func:`get_worker_info`: inside a rank, torch's ``WorkerInfo`` with
  ``id=RANK`` and ``num_workers=WORLD_SIZE``; outside a rank, ``None``.
- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`checkpoint_path`: what a run
  restarted by ``--restarts`` resumes from (taas_magic/checkpoints.py).
- :func:`report` / :func:`metrics`: metrics drawn live in the cell (taas_magic/output/board.py).
- :func:`wait`: a detached run's names and value, once it ends (``%taas wait``).
- :func:`trial`: the trial a search's cell (``--trials K``) takes its hyperparameters from;
  alone, a fixed trial of the suggestions' defaults. :func:`trials` / :func:`study`: the last
  search's trials and its Optuna study.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["register", "unregister", "registered", "get_worker_info", "in_rank",
           "save_checkpoint", "load_checkpoint", "checkpoint_path", "report", "metrics", "lightning_logger", "wait",
           "trial", "trials", "study"]

_registered: list[Any] = []

# Set by the rank bootstrap (taas_magic.rank) in the rank processes it starts; a
# subprocess the cell starts inherits the environment but is not a rank.
_IN_RANK = False
_DEVICE = "cpu"  # in a rank: "cuda" when it has its own GPU (set by the rank bootstrap)
_SEED = 0  # in a rank: the run's seed (set by the rank bootstrap from the run spec)
_last_metrics: list[dict] = []  # in the kernel: the last run's rank-0 reports (set by the magic)


def in_rank() -> bool:
    """True inside a process that taas started to run a cell as one rank."""
    return _IN_RANK


def register(loader: Any) -> Any:
    """Register a DataLoader (or any re-iterable, picklable object) for data workers.

    Returns the loader, so ``train_loader = taas.register(DataLoader(...))`` works.

    Raises:
        TypeError: the object cannot be iterated or cannot be pickled.
    """
    if not hasattr(loader, "__iter__"):
        raise TypeError(
            f"taas.register: {type(loader).__name__} object is not iterable; "
            "register a DataLoader or another object that can be iterated more than once"
        )
    if hasattr(loader, "__next__"):
        raise TypeError(
            f"taas.register: {type(loader).__name__} is an iterator, which can be consumed only once; "
            "register the re-iterable object that produces it (e.g. the DataLoader)"
        )
    from taas_magic.transfer import pickler

    try:
        pickler.dumps(loader)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the person's to fix
        raise TypeError(
            f"taas.register: {type(loader).__name__} cannot be pickled ({type(exc).__name__}: {exc}); "
            "data workers run in other processes and must receive the loader"
        ) from None
    if not any(item is loader for item in _registered):
        _registered.append(loader)
    return loader


def unregister(loader: Any) -> None:
    """Return a registered loader to normal; unknown loaders are ignored."""
    _registered[:] = [item for item in _registered if item is not loader]


def registered() -> list[Any]:
    """The registered loaders, in registration order."""
    return list(_registered)


def get_worker_info() -> Any:
    """Inside a rank, torch's ``WorkerInfo(id=RANK, num_workers=WORLD_SIZE, seed=run seed + RANK)``; else ``None``."""
    if not _IN_RANK:
        return None
    from torch.utils.data._utils.worker import WorkerInfo

    rank = int(os.environ["RANK"])
    return WorkerInfo(
        id=rank,
        num_workers=int(os.environ["WORLD_SIZE"]),
        seed=_SEED + rank,
        dataset=None,  # type: ignore[arg-type]  # a rank has no dataset of its own
    )


def save_checkpoint(obj: Any) -> str | None:
    """Save ``obj`` (anything ``torch.save`` takes) as this run's newest checkpoint.

    Every rank may call it; only rank 0's lands, written atomically (temporary file, fsync,
    rename), so a rank killed mid-save never leaves a torn checkpoint. Returns the file's
    path on rank 0 and None on the others.

    Raises:
        RuntimeError: outside a taas cell (use ``torch.save`` there).
    """
    if not _IN_RANK:
        raise RuntimeError("taas.save_checkpoint works inside a taas cell; in the notebook, use torch.save")
    if os.environ.get("RANK") != "0":
        return None
    from taas_magic import checkpoints

    folder = checkpoints.run_folder()
    assert folder is not None  # the kernel names it in every rank's spec
    return checkpoints.save(obj, folder, checkpoints.kept())


def load_checkpoint(map_location: Any = None) -> Any:
    """The newest object rank 0 saved with :func:`save_checkpoint` in this run, or None before the first.

    In a rank its tensors land on the rank's own device (``map_location`` overrides that);
    in the notebook, after a cell, it is the last run's newest checkpoint, on the CPU.
    """
    from taas_magic import checkpoints

    if map_location is None:
        map_location = _own_device() if _IN_RANK else "cpu"
    return checkpoints.load(checkpoints.run_folder(), map_location)


def checkpoint_path() -> str | None:
    """The file :func:`load_checkpoint` would read now (this run's newest; the last run's in the notebook)."""
    from taas_magic import checkpoints

    return checkpoints.newest(checkpoints.run_folder())


def _own_device() -> Any:
    import torch

    if _DEVICE == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def report(step: Any = None, **metrics: Any) -> None:
    """Draw ``metrics`` (numbers, or one-element tensors) in the cell's live chart, against ``step``.

    Callable on any rank; rank 0's values are drawn as lines, and a metric every rank reports
    gets the ranks' min-max band. ``step`` defaults to the report's number. Costs about a
    microsecond: reports leave the rank in batches. Outside a taas cell it does nothing, so the
    same code runs in a plain cell.
    """
    # Outside a rank there is nothing to do; inside one, the rank's bootstrap has put
    # taas_magic.output.reports.report here instead.


def metrics() -> list[dict]:
    """The last taas run's rank-0 reports, in order: ``[{"step": 0, "loss": 1.0, ...}, ...]``."""
    return [dict(item) for item in _last_metrics]


def wait(run: str | None = None) -> Any:
    """Wait for a run of this kernel (a ``--detach`` one) to end, then bind rank 0's names in the
    notebook and return its final value, exactly as a foreground cell would; raise its error if it
    failed. ``run``: its id or a prefix (default: the newest running run, else the newest whose
    names were not taken). ``%taas wait [RUN]`` is the same.

    Raises:
        RuntimeError: outside an IPython kernel with the taas_magic extension loaded.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or shell.find_line_magic("taas") is None:
        raise RuntimeError("taas.wait(): the taas_magic extension is not loaded here (%load_ext taas_magic)")
    return shell.run_line_magic("taas", f"wait {run}" if run else "wait")


def trial() -> Any:
    """The trial this cell's hyperparameters come from: Optuna's ``suggest_float``, ``suggest_int``,
    ``suggest_categorical``, ``number`` and ``params``, plus ``default=`` on each suggestion.

    In a rank of a search's trial (``#pragma taas --trials K``), each suggestion is the search's
    value, the same for every rank of the trial. Anywhere else it is the suggestion's ``default=``,
    so the same cell runs alone; a suggestion without one raises ``ValueError``.
    """
    from taas_magic.search.trial import trial as current

    return current()


def trials() -> Any:
    """The last search's trials (number, params, value, state, seconds, log): a pandas DataFrame when
    pandas is installed, else a list of dicts. ``%taas trials`` is the same."""
    return _line_magic("trials")


def study() -> Any:
    """The last search's Optuna study (``study.best_trial``, ``optuna.visualization``...). ``%taas study``."""
    return _line_magic("study")


def _line_magic(command: str) -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or shell.find_line_magic("taas") is None:
        raise RuntimeError(f"taas.{command}(): the taas_magic extension is not loaded here (%load_ext taas_magic)")
    return shell.run_line_magic("taas", command)


def lightning_logger() -> Any:
    """A Lightning logger that draws what ``self.log`` logs in the taas cell's chart.

    Not needed in a taas cell (a Trainer there gets one unless ``logger=False``); pass it to
    keep it beside loggers of your own in code that also runs elsewhere.
    """
    from taas_magic.rank import lightning

    return lightning.logger(report)

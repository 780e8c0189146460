"""``import taas``: the notebook-side API of taas_magic.

Runs wherever ``import taas`` is: in the kernel, on the cell's thread (the notebook's calls), in
each rank (the cell's calls), and in a data worker whose loader's code imports it.

An API-compatible, open replacement for the hosted platform's client of the same
name (the two packages both provide a top-level ``taas`` module and cannot be
installed side by side).

This module is a face: every call passes through to the package, where its state lives and is
read at each call (so the cell's ``import taas`` sees what the rank bootstrap set); the package
never imports this module. It imports nothing heavy: torch is imported only by the calls that
need it (:func:`get_worker_info` and the checkpoint calls).

- :func:`register` / :func:`unregister` / :func:`registered`: the DataLoaders that
  taas data workers prepare for the ranks (``--cpus``/``--units``; taas_magic/feed/registry.py).
- :func:`in_rank` / :func:`get_worker_info`: inside a rank, torch's ``WorkerInfo`` with
  ``id=RANK`` and ``num_workers=WORLD_SIZE``; outside a rank, ``None`` (taas_magic/rank/identity.py).
- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`checkpoint_path`: what a run
  restarted by ``--restarts`` resumes from (taas_magic/writes/checkpoints.py, via rank/identity.py);
  a sharded state is saved by every rank together (DCP).
- :func:`shared`: a folder every rank writes in place, for a saver taas does not recognise
  (taas_magic/writes/savers.py, via rank/identity.py).
- :func:`report` / :func:`metrics`: metrics drawn live in the cell (taas_magic/output/board.py;
  the last run's kept by the session, read through taas_magic/kernel/magic/fromcode.py).
- :func:`wait`: a detached run's names and value, once it ends (``%taas wait``; taas_magic/kernel/magic/fromcode.py).
- :func:`trial`: the trial a search's cell (``--trials K``) takes its hyperparameters from;
  alone, a fixed trial of the suggestions' defaults (taas_magic/search/trial.py). :func:`trials` /
  :func:`study`: the last search's trials and its Optuna study.
"""

from __future__ import annotations

from typing import Any

from taas_magic.feed import registry as _registry
from taas_magic.kernel.magic import fromcode as _fromcode
from taas_magic.rank import identity as _identity

__all__ = ["register", "unregister", "registered", "get_worker_info", "in_rank",
           "save_checkpoint", "load_checkpoint", "checkpoint_path", "shared", "report", "metrics", "lightning_logger", "wait",
           "trial", "trials", "study", "load_job"]


def in_rank() -> bool:
    """True inside a process that taas started to run a cell as one rank."""
    return _identity.in_rank()


def register(loader: Any) -> Any:
    """Register a DataLoader (or any re-iterable, picklable object) for data workers.

    Returns the loader, so ``train_loader = taas.register(DataLoader(...))`` works.

    Raises:
        TypeError: the object cannot be iterated or cannot be pickled.
    """
    return _registry.register(loader)


def unregister(loader: Any) -> None:
    """Return a registered loader to normal; unknown loaders are ignored."""
    _registry.unregister(loader)


def registered() -> list[Any]:
    """The registered loaders, in registration order."""
    return _registry.registered()


def get_worker_info() -> Any:
    """Inside a rank, torch's ``WorkerInfo(id=RANK, num_workers=WORLD_SIZE, seed=run seed + RANK)``; else ``None``."""
    return _identity.get_worker_info()


def save_checkpoint(obj: Any, sharded: bool | None = None) -> str | None:
    """Save ``obj`` (anything ``torch.save`` takes) as this run's newest checkpoint.

    Every rank may call it; only rank 0's lands, written atomically (temporary file, fsync,
    rename), so a rank killed mid-save never leaves a torn checkpoint. Returns the file's
    path on rank 0 and None on the others.

    A sharded ``obj`` (one holding DTensors, such as an FSDP2 model's state dict; or ``sharded=True``)
    is saved by every rank together with ``torch.distributed.checkpoint``, each rank writing its own
    part into the checkpoint's folder; every rank must call it, and every rank gets the folder back.
    A sharded save that did not finish (no ``.metadata``) is never resumed from.

    Raises:
        RuntimeError: outside a taas cell (use ``torch.save`` there); a sharded save outside a process group.
    """
    return _identity.save_checkpoint(obj, sharded)


def load_checkpoint(map_location: Any = None, into: Any = None) -> Any:
    """The newest whole checkpoint saved with :func:`save_checkpoint` in this run, or None before the first.

    In a rank its tensors land on the rank's own device (``map_location`` overrides that);
    in the notebook, after a cell, it is the last run's newest checkpoint, on the CPU. A sharded
    checkpoint is loaded into ``into`` (your state dict, sharded as you want it), which is returned;
    in the notebook, without ``into``, it comes back whole as one state dict.
    """
    notebook = None if _identity.in_rank() else _fromcode.last_checkpoints()
    return _identity.load_checkpoint(map_location, notebook, into)


def shared(path: Any) -> str:
    """Let this rank write ``path``, a folder of the repository, in place from now on; returns it, absolute.

    For a saver taas does not recognise, in which every rank writes its own files into one folder
    (torch's DCP, accelerate's ``save_state``, the HF Trainer and Lightning are recognised): call it on
    every rank before the save, or give the folder to the pragma as ``--shared DIR``. Every other
    write of the ranks other than 0 stays diverted. Outside a taas cell it does nothing.
    """
    return _identity.shared(path)


def checkpoint_path() -> str | None:
    """The file :func:`load_checkpoint` would read now (this run's newest; the last run's in the notebook)."""
    return _identity.checkpoint_path(None if _identity.in_rank() else _fromcode.last_checkpoints())


def report(step: Any = None, **metrics: Any) -> None:
    """Draw ``metrics`` (numbers, or one-element tensors) in the cell's live chart, against ``step``.

    Callable on any rank; rank 0's values are drawn as lines, and a metric every rank reports
    gets the ranks' min-max band. ``step`` defaults to the report's number. Costs about a
    microsecond: reports leave the rank in batches. Outside a taas cell it does nothing, so the
    same code runs in a plain cell.
    """
    # Read at each call: in a rank, the bootstrap made it taas_magic.output.reports.report;
    # elsewhere it ignores the report.
    _identity.reporter(step, **metrics)


def metrics() -> list[dict]:
    """The last taas run's rank-0 reports, in order: ``[{"step": 0, "loss": 1.0, ...}, ...]``."""
    return _fromcode.last_metrics()


def wait(run: str | None = None) -> Any:
    """Wait for a run of this kernel (a ``--detach`` one) to end, then bind rank 0's names in the
    notebook and return its final value, exactly as a foreground cell would; raise its error if it
    failed. ``run``: its id or a prefix (default: the newest running run, else the newest whose
    names were not taken). ``%taas wait [RUN]`` is the same.

    Raises:
        RuntimeError: outside an IPython kernel with the taas_magic extension loaded.
    """
    return _fromcode.wait(run)


def trial() -> Any:
    """The trial this cell's hyperparameters come from: Optuna's ``suggest_float``, ``suggest_int``,
    ``suggest_categorical``, ``number`` and ``params``, plus ``default=`` on each suggestion.

    In a rank of a search's trial (``#pragma taas --trials K``), each suggestion is the search's
    value, the same for every rank of the trial. Anywhere else it is the suggestion's ``default=``,
    so the same cell runs alone; a suggestion without one raises ``ValueError``.
    """
    from taas_magic.search.trial import trial as current  # imported when first asked: it loads the protocol

    return current()


def trials() -> Any:
    """The last search's trials (number, params, value, state, seconds, log): a pandas DataFrame when
    pandas is installed, else a list of dicts. ``%taas trials`` is the same."""
    return _fromcode.trials()


def study() -> Any:
    """The last search's Optuna study (``study.best_trial``, ``optuna.visualization``...). ``%taas study``."""
    return _fromcode.study()


def load_job(script: str) -> dict:
    """Rank 0's names from the last run of a job ``%taas export`` wrote (``python SCRIPT``, torchrun, sbatch or
    Ray), bound in this notebook and returned by name. It unpickles the job folder's ``results.pt``, so it refuses
    a folder that is not yours alone."""
    from taas_magic.export.job import load_results

    names = load_results(script)
    shell = _fromcode.shell()
    if shell is not None:
        shell.user_ns.update(names)
    return names


def lightning_logger() -> Any:
    """A Lightning logger that draws what ``self.log`` logs in the taas cell's chart.

    Not needed in a taas cell (a Trainer there gets one unless ``logger=False``); pass it to
    keep it beside loggers of your own in code that also runs elsewhere.
    """
    return _identity.lightning_logger()

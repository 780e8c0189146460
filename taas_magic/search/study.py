"""The search's Optuna study: its sampler, its pruner, where it is kept.

Runs in the kernel: made on the cell's thread as the search is planned, asked and told on the
search's own thread.

No search algorithm is ours: ``--sampler tpe|random|grid`` is Optuna's ``TPESampler``
(with ``constant_liar``, which keeps trials running side by side from being given the same
point: Optuna 5's default, set here for Optuna 4 too), ``RandomSampler`` or ``GridSampler``
(its grid read from the cell, search/space.py); ``--prune median|halving|none`` is ``MedianPruner``,
``SuccessiveHalvingPruner`` or ``NopPruner``, each with Optuna's defaults (the median
pruner prunes nothing before 5 trials have completed).

A study is in memory, for this cell's search, unless ``--study NAME`` names one: then it
is kept in ``<repository>/.taas/studies.db`` (SQLite through Optuna's RDB storage, the
file owner-only), and a rerun of the cell continues it: its sampler sees every earlier
trial. A study kept with the other direction is refused rather than continued the wrong
way. Optuna is imported only here and only for a search; where it is missing the search
fails with the line to install it.

Optuna's own log lines ("Trial 3 finished ...") are turned down to warnings when a search
starts: the search's table says the same, in place.

:func:`tell` tells the study how a trial ended (its value; pruned; failed, which a trial
stopped by an interrupt is too, so a ``--study`` file keeps no trial marked running).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from taas_magic.errors import SearchError
from taas_magic.import_hooks import import_on_own_stack

STUDIES_FILE = "studies.db"
# A trial's states as the search's table and taas.trials() name them (a stopped trial is told to Optuna as failed)
COMPLETE, PRUNED, FAILED, STOPPED, RUNNING = "complete", "pruned", "failed", "stopped", "running"


def optuna_module() -> Any:
    try:
        optuna = import_on_own_stack("optuna")  # not from the magic's stack: Optuna keeps ImportErrors (import_hooks.py)
    except ImportError:
        raise SearchError("taas: --trials needs Optuna: pip install 'taas-magic[trials]' (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(sampler: str, prune: str, maximize: bool, name: str | None, repository: str,
               grid: dict[str, list[Any]] | None = None) -> Any:
    """The study a search asks and tells (see the module docstring); ``grid`` for ``--sampler grid``."""
    optuna = optuna_module()
    # constant_liar explicitly: Optuna 4's TPESampler leaves it off (5 turns it on), and trials run side by side
    samplers = {"tpe": lambda: optuna.samplers.TPESampler(constant_liar=True), "random": lambda: optuna.samplers.RandomSampler(),
                "grid": lambda: optuna.samplers.GridSampler(grid or {})}
    pruners = {"median": optuna.pruners.MedianPruner, "halving": optuna.pruners.SuccessiveHalvingPruner,
               "none": optuna.pruners.NopPruner}
    direction = "maximize" if maximize else "minimize"
    storage = _storage(repository) if name is not None else None
    study = optuna.create_study(storage=storage, sampler=samplers[sampler](), pruner=pruners[prune](),
                                study_name=name, direction=direction, load_if_exists=True)
    if study.direction.name.lower() != direction:
        kept = study.direction.name.lower()
        raise SearchError(f"taas: study {name!r} in {storage} was made to {kept}; "
                          f"{'drop' if kept == 'minimize' else 'add'} --maximize to continue it, or name another --study")
    return study


def _storage(repository: str) -> str:
    folder = os.path.join(repository, ".taas")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, STUDIES_FILE)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # owner-only before SQLite writes to it
    return f"sqlite:///{path}"


def studies_path(repository: str) -> str:
    return os.path.join(repository, ".taas", STUDIES_FILE)


def tell(study: Any, lock: threading.Lock, trial: Any, state: str, value: float | None) -> None:
    """Optuna is told how its ``trial`` ended: its value, or pruned, or failed (a stopped trial too),
    under the search's ``lock`` (trials side by side end on threads of their own)."""
    from optuna.trial import TrialState

    states = {PRUNED: TrialState.PRUNED, FAILED: TrialState.FAIL, STOPPED: TrialState.FAIL}
    with lock:
        try:
            if state == COMPLETE:
                study.tell(trial, value)
            else:
                study.tell(trial, state=states[state])
        except RuntimeError:
            # IMPORTANT: GridSampler.after_trial calls study.stop() once its grid is used up, which
            # raises outside study.optimize(); tell has stored the trial's state by then (its finally)
            if type(study.sampler).__name__ != "GridSampler":
                raise

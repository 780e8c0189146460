"""The plan step of a search (``--trials K``): its slots, its study, its header, before any trial starts.

Runs in the kernel, on the cell's thread.

:func:`plan_search` decides, in the cell, what every trial will share, and fails there with
one line and nothing started when it cannot:

- the slots, the trials at a time (:func:`search_slots`): on a host with GPUs, as many as
  its GPUs hold trials of ``--gpus`` ranks, each trial on its own slice of them (its ranks
  see only that slice, ``CUDA_VISIBLE_DEVICES``, so ``LOCAL_RANK`` indexes it), ``--parallel``
  fewer; on a host without GPUs one, or ``--parallel P`` (they share the cores); on an
  attached cluster as many as its GPUs hold, each trial placed by the cluster as a run is.
  Each trial's rendezvous port is its own (the backend reserves it);
- the study (search/study.py), with ``--sampler grid``'s grid read from the cell
  (search/space.py);
- the search's log, whose header says all of that.

Local GPUs held by another run of this kernel (a detached one) refuse the search, as they
refuse a run.
"""

from __future__ import annotations

import secrets
from typing import Callable

from IPython.core.error import UsageError

from taas_magic.cell.cellcode import CellCode
from taas_magic.cell.pragma import RunSettings
from taas_magic.errors import LaunchError
from taas_magic.kernel.runs.runplan import PlanContext
from taas_magic.kernel.runs.session import Session
from taas_magic.kernel.runs.summary import gpus_held_text
from taas_magic.kernel.trials.searchrun import SearchPlan, SearchRun
from taas_magic.launch.rankenv import visible_gpu_count
from taas_magic.output.runlog import RunLog
from taas_magic.search.space import grid_points, grid_space
from taas_magic.search.study import open_study, optuna_module, studies_path

Context = Callable[[int, int], PlanContext]  # (slot, slots) -> the plan context of a trial on that slot


def search_slots(settings: RunSettings, cluster_gpus: int | None, host_gpus: int) -> tuple[int, bool, str]:
    """Trials at a time, whether they hold this host's GPUs, and why that many (for the header)."""
    assert settings.trials is not None
    gpus, parallel = settings.gpus, settings.parallel
    if cluster_gpus is not None:
        fits = max(1, cluster_gpus // gpus)
        slots, why = (parallel, "--parallel") if parallel else (fits, f"the cluster's {cluster_gpus} GPU(s)")
        on_gpus = False
    elif host_gpus and settings.device != "cpu":
        fits = host_gpus // gpus
        if parallel and parallel > fits:
            raise UsageError(f"taas: --parallel {parallel} trials of --gpus {gpus} need {parallel * gpus} GPUs; "
                             f"this host has {host_gpus}")
        slots, why = (parallel, "--parallel") if parallel else (max(1, fits), f"{host_gpus} GPU(s) / --gpus {gpus}")
        on_gpus = True
    else:
        slots, why = (parallel, "--parallel") if parallel else (1, "no GPU: one at a time unless --parallel P")
        on_gpus = False
    return min(slots, settings.trials), on_gpus, why


def plan_search(settings: RunSettings, code: CellCode, closure: dict, why: str | None, session: Session,
                context: Context) -> SearchRun:
    """The search, ready to start (see the module docstring)."""
    assert settings.trials is not None
    optuna = optuna_module()
    cluster_gpus = sum(node.gpus_total for node in session.cluster.nodes()) if session.cluster is not None else None
    slots, on_gpus, slots_why = search_slots(settings, cluster_gpus, visible_gpu_count())
    holder = session.runs.gpu_holder() if on_gpus else None
    if holder is not None:
        raise LaunchError(gpus_held_text(holder.summary()))
    grid = grid_space(code.tree) if settings.sampler == "grid" else None
    repository = session.write_rule().repository
    study = open_study(settings.sampler, settings.prune, settings.maximize, settings.study, repository, grid)
    direction = "maximise" if settings.maximize else "minimise"
    lines = [f"taas: search of {settings.trials} trial(s) of {settings.gpus} rank(s) each"
             + (f" ({why})" if why else "") + f", {slots} at a time ({slots_why})",
             f"taas: Optuna {optuna.__version__}: sampler {settings.sampler}"
             + (f" over {grid_points(grid)} grid point(s)" if grid else "")
             + f", pruner {settings.prune}; {direction} the last {settings.objective!r} rank 0 reports"]
    if settings.study is not None:
        before = len(study.trials)
        lines.append(f"taas: study {settings.study!r} in {studies_path(repository)}: {before} trial(s) before this cell")
    log = RunLog(f"search-{secrets.token_hex(6)}")
    log.header("\n".join(lines))
    search = SearchPlan(settings, code, closure, why, lambda slot: context(slot, slots), slots, on_gpus, grid)
    return SearchRun(search, study, log, session)

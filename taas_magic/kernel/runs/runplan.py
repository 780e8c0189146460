"""The plan step: everything a cell's run needs, decided and held before anything starts.

Runs in the kernel, on the cell's thread (for a search's trials, on the search's own thread:
kernel/trials/searchrun.py). :func:`plan` takes the closure as shipped, the data run (when the cell
reads registered loaders) and the backend (the magic's one choice of local processes or the attached
cluster: a cluster's GPUs are held from then on), decides the write rule and the run spec every rank
receives, then makes the run (kernel/runs/run.py), which takes the rest (its log, folders, layers,
server and handoff), and writes the header as the log's first entry. A plan that fails half-way
releases what it took and raises one clear error: nothing was launched. Local GPUs held by another
run of this kernel (a detached one) are such an error, naming that run.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Callable

from IPython.core.interactiveshell import InteractiveShell

from taas_magic.cell.cellcode import CellCode, earlier_cells
from taas_magic.cell.closure import serialise_closure
from taas_magic.cell.pragma import RunSettings
from taas_magic.debugger import panel
from taas_magic.errors import LaunchError
from taas_magic.feed import registry
from taas_magic.kernel.runs.rankset import ONE_CELL, RankSet, Shape
from taas_magic.kernel.runs.run import Held, Run
from taas_magic.kernel.runs.session import Session
from taas_magic.kernel.runs.summary import LastRun, closure_size, gpus_held_text, header_line
from taas_magic.kernel.supervision.dataplane import DataRun
from taas_magic.launch.contract import Backend
from taas_magic.runspec import PanelPlan, RunSpec
from taas_magic.search.link import TrialLink
from taas_magic.transfer import cudaipc, memfile
from taas_magic.transfer.handoff import closure_route
from taas_magic.transfer.sharded import gather_limit
from taas_magic.writes import unseen
from taas_magic.writes.rule import WriteRule, resolve_shared

INLINE_ALWAYS = 1 << 62  # a threshold no closure reaches: its bytes travel in the frames


@dataclass(frozen=True)
class PlanContext:
    """What planning reads from the magic: the session, the shell, its backend choice and settings."""

    session: Session
    shell: InteractiveShell
    backend: Callable[[RunSettings], Backend]  # the one place that chooses local or cluster (magics.py)
    checkpoint_dir: str  # TaasMagics.checkpoint_dir
    keep_checkpoints: int  # TaasMagics.keep_checkpoints
    closure_file_bytes: int  # TaasMagics.closure_file_bytes
    compile_cache: str = ""  # the session's compile cache folder (TaasMagics.compile_cache; empty: off)
    lazy_bytes: int = 0  # TaasMagics.lazy_bytes: kept cells' names this large stay on the ranks (keptnames.py)


def plan(settings: RunSettings, code: CellCode, closure: dict, why: str | None, context: PlanContext,
         trial: TrialLink | None = None) -> Run:
    """Everything the run needs, decided and held before anything starts; the header is its log's first entry.
    A search's ``trial`` is told to its ranks (its number) and answers their suggestions (kernel/trials/searchrun.py)."""
    registered = registry.registered()
    session = context.session
    run_id = secrets.token_hex(6)
    # the one place that chooses a lifetime: the session's kept ranks (--keep), or the run's own
    ranks, ranks_lines = _kept(settings, context) if settings.keep else (
        RankSet(Shape(settings.gpus, settings.device, ""), ONE_CELL, run_id), [])
    if not ranks.running:  # (a cell on running kept ranks skips it, about 1 ms: their first cell swept)
        memfile.sweep_all()  # what a killed kernel left in /dev/shm
    closure = ranks.closure_for(closure, registered)
    packing = serialise_closure(closure, registered)
    with ExitStack() as releases:  # a plan that fails half-way releases what it took
        used = sorted(packing.externals_used)
        data = DataRun({index: registered[index] for index in used}, context.shell.user_ns, settings) if used else None
        if data is not None:
            releases.callback(data.close)
        ranks.lend(releases, lambda: context.backend(settings), data.workers if data is not None else 0)
        backend = ranks.backend
        held = Held(settings, packing, registered, data, backend, trial, sent=closure)
        on_local_gpus = backend.devices.device == "cuda" and backend.loopback_only
        # a search's trials hold their own slices of the GPUs (the search itself is the holder)
        holder = session.runs.gpu_holder() if on_local_gpus and trial is None else None
        if holder is not None:
            raise LaunchError(gpus_held_text(holder.summary()))
        if on_local_gpus and session.kept is not None and session.kept is not ranks and session.kept.holds_local_gpus:
            raise LaunchError(f"taas: the kept ranks ({session.kept.shape}) hold this host's GPUs: %taas release "
                              "ends them, or run this cell with --keep")
        rule = session.write_rule()
        try:
            shared = resolve_shared(settings.shared, rule.repository, os.getcwd())
        except ValueError as exc:
            raise LaunchError(f"taas: {exc}") from None
        spec = _spec(run_id, held, code, rule, context, shared)
        tensor_bytes = memfile.layout([blob.nbytes for blob in packing.blobs])[1]
        route = closure_route(packing, spec.cuda_ipc, spec.result_file_bytes)
        closure_text = closure_size(len(packing.skeleton) + tensor_bytes, route)
        in_place = "written in place by every rank: " + ", ".join(os.path.relpath(f, rule.repository) for f in shared)
        lines = [header_line(settings, backend.devices, spec.run_id, closure_text, why), *ranks_lines, rule.header(),
                 in_place if shared else None,
                 backend.layout(), data.header() if data is not None else None]
        session.last_run = LastRun(settings, backend.devices, spec.run_id, tuple(closure), spec.checkpoints)
        run = Run(held, releases.pop_all(), spec, rule, session.last_run, ranks)  # whole: it releases all of it from now on
        if spec.compile_cache:  # its ranks on this host, once gone: did they compile?
            run.on_ranks_gone.append(session.ranks_gone)
    try:
        run.log.header("\ntaas: ".join(line for line in lines if line))
    except BaseException:
        run.close()
        raise
    return run


def _kept(settings: RunSettings, context: PlanContext) -> tuple[RankSet, list[str]]:
    """The kept ranks a ``--keep`` cell runs in, and the header's lines about them (kernel/runs/rankset.py)."""
    if settings.restarts:
        raise LaunchError("taas: --keep with --restarts: a restart starts new ranks, which would lose what the kept "
                          "ones hold (a kept cell that fails keeps its ranks where it can): leave out one of them")
    cluster, kept = context.session.cluster, context.session.kept
    shape = Shape(settings.gpus, settings.device, "", id(cluster) if cluster is not None else 0, settings.per_host)
    if kept is None or kept.shape != shape:  # new ranks: their words, where they run (a cluster asked only now)
        where = "this host" if cluster is None else cluster.status_lines()[0].split(",")[0].removeprefix("cluster: ")
        shape = replace(shape, where=where)
    kept, ended = context.session.kept_for(shape, lambda: context.backend(settings))
    if kept.running:
        since = time.strftime("%H:%M:%S", time.localtime(kept.started))
        return kept, [line for line in (ended, f"--keep: cell {kept.cells + 1} on the kept ranks (started {since})") if line]
    why = kept.ranks.ended_why()
    lost = f" (the last kept ranks ended: {why})" if why else ""
    return kept, [line for line in (ended, f"--keep: new ranks, kept after this cell{lost}; %taas release ends them") if line]


def _spec(run_id: str, held: Held, code: CellCode, rule: WriteRule, context: PlanContext,
          shared: tuple[str, ...]) -> RunSpec:
    """What every rank receives: the cell, where it runs, and the run's data (checkpoints, seed, the gather's limit)."""
    backend, data, trial = held.backend, held.data, held.trial
    root = context.checkpoint_dir or os.path.join(rule.repository, ".taas", "checkpoints")
    limit, why = gather_limit()
    return RunSpec(
        run_id=run_id, sys_path=tuple(sys.path), source=code.source, display_source=code.display_source,
        filename=code.filename, device=backend.devices.device, output=held.settings.output,
        suppress_final=code.suppress_final, kernel_pid=os.getpid(),
        result_file_bytes=context.closure_file_bytes if backend.memory_files else INLINE_ALWAYS,
        feeds=data.rank_feeds() if data is not None else (), cells=earlier_cells(context.shell, held.packing.skeleton),
        # CUDA tensors by CUDA IPC: only among processes of this host on its GPUs, the kernel's CUDA in use
        cuda_ipc=backend.memory_files and backend.devices.device == "cuda" and cudaipc.kernel_ready(),
        checkpoints=os.path.join(os.path.realpath(os.path.expanduser(root)), run_id),
        trial=trial.number if trial is not None else None,
        post_mortem=bool(getattr(context.shell, "call_pdb", False)) and trial is None,  # IPython's %pdb on
        gather_bytes=limit, gather_why=why,  # how much of a sharded name may come back whole to this host
        keep_checkpoints=context.keep_checkpoints, shared=shared, keep=held.settings.keep,
        lazy_bytes=context.lazy_bytes if held.settings.keep and held.trial is None else 0,
        compile_cache=context.compile_cache if backend.loopback_only else "",  # a folder of this host: its ranks only
        seed=data.seed if data is not None else secrets.randbits(31), profile=held.settings.profile,
        repository_names=() if backend.loopback_only else unseen.names(rule.repository),  # for hosts that do not see it
        panel=_panel_plan(code.display_source, trial is None),
    )


def _panel_plan(cell: str, watched: bool) -> PanelPlan | None:
    """JupyterLab's debugger panel on: the cell's breakpoints for its ranks (debugger/); a search's trials run without."""
    found = panel.current()
    return found.plan(cell) if found is not None and watched else None

"""What the ``%taas`` line commands do to the session: ``status``, ``config repo PATH``, ``config
isolation auto|overlay|python``, ``warm off|auto|N``, ``cluster [ADDRESS|slurm [OPTIONS]|off]``;
``trials`` and ``study``, the last search's. The runs' are runcommands.py's; which line calls
which is the table of kernel/magic/commands.py.

Each applies one command to the session's state (kernel/runs/session.py), printing what it did;
a value it refuses raises IPython's ``UsageError`` with the line the cell shows. The session's
settings stay the magic's traitlets (``%config TaasMagics.warm``): the magic
(kernel/magic/magics.py) passes them in as :class:`MagicSettings`, their values and the one
setter a command needs (``warm``), so nothing here refers back to the magic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from IPython.core.error import UsageError

from taas_magic.cell.options import shown_defaults
from taas_magic.errors import ClusterError
from taas_magic.feed import registry
from taas_magic.kernel.magic import runcommands
from taas_magic.kernel.magic.status import status_text
from taas_magic.kernel.runs.session import Session, Warm
from taas_magic.kernel.supervision.dataplane import describe_registered
from taas_magic.kernel.trials.searchrun import SearchRun, trials_table
from taas_magic.launch.attachment import Attachment, Cluster
from taas_magic.launch.rankenv import Binding, visible_gpu_count
from taas_magic.launch.spares import gpu_bytes
from taas_magic.writes.rule import MODES, OVERLAY, probe_overlay


@dataclass(frozen=True)
class MagicSettings:
    """The magic's traitlets as a command sees them."""

    warm: str  # TaasMagics.warm
    set_warm: Callable[[str], None]  # sets TaasMagics.warm (validated as any setting is)
    defaults: dict[str, object]  # every option's session default, by setting name
    namespace: dict  # the notebook's names, to describe the registered loaders
    viewing: runcommands.Viewing  # how a run is shown in this cell (attach)
    take: runcommands.Take  # binds a finished run's names in the notebook (wait)


def trials(session: Session) -> object:
    """``%taas trials``: the last search's trials (a pandas DataFrame where pandas is installed)."""
    return trials_table(_last_search(session).trials)


def study(session: Session) -> object:
    """``%taas study``: the last search's Optuna study."""
    return _last_search(session).study


def _last_search(session: Session) -> SearchRun:
    searches = [run for run in session.runs.all() if isinstance(run, SearchRun)]
    if not searches:
        raise UsageError("taas: no search has run in this kernel yet (a cell with --trials K)")
    return searches[-1]


def _set_repository(session: Session, given: str) -> None:
    """``%taas config repo PATH``."""
    path = os.path.realpath(os.path.expanduser(given))
    if not os.path.isdir(path):
        raise UsageError(f"taas: the repository must be a directory, got {given!r}")
    session.repository = path
    print(f"taas: repository {path}")


def _set_isolation(session: Session, mode: str) -> None:
    """``%taas config isolation auto|overlay|python``: overlay refused where this host has none."""
    if mode not in MODES:
        raise UsageError(f"taas: isolation must be one of {', '.join(MODES)}, got {mode!r}")
    unavailable = probe_overlay() if mode == OVERLAY else None
    if unavailable is not None:
        raise UsageError(f"taas: isolation overlay is unavailable on this host ({unavailable}); "
                         "use auto or python")
    session.isolation = mode
    print(f"taas: isolation {mode}")


def _set_warm(session: Session, settings: MagicSettings, text: str) -> None:
    """``%taas warm off|auto|N``."""
    try:
        warm = Warm.parse(text)
    except ValueError:
        raise UsageError(f"taas: warm must be off, auto or a number of spares, got {text!r}") from None
    settings.set_warm(text)
    if warm.off:
        session.spares.close()
        print("taas: warm spares off")
    elif warm.count is not None:
        session.spares.keep(warm.count)
        print(f"taas: keeping {text} warm spare rank(s)")
    else:
        print("taas: after each cell, keeping as many warm spares as its --gpus")


def _cluster(session: Session, given: str) -> None:
    """``%taas cluster`` (what is attached) | ``ADDRESS`` (Ray) | ``slurm [OPTIONS]`` | ``off`` (or ``local``)."""
    if not given:
        print("\n".join(session.cluster.status_lines()) if session.cluster is not None
              else "cluster: none (local processes); %taas cluster ADDRESS attaches a Ray cluster, "
                   "%taas cluster slurm [OPTIONS] a Slurm allocation")
        return
    if given in ("off", "local"):
        _detach(session)
        print("taas: local mode (ranks are processes on this host)")
        return
    previous = session.cluster
    if given.split()[0] == "slurm":
        attached: Attachment = hold_allocation(given[len("slurm"):].strip())  # the current one stays until this one holds
    else:
        try:
            attached = Cluster.attach(given)  # an unreachable address fails before the current one is let go
        except ClusterError:
            if isinstance(session.cluster, Cluster) and not session.cluster.ray.is_initialized():
                session.cluster = None  # Ray let go of it before failing: the local mode now
            raise
        if isinstance(previous, Cluster):
            previous = None  # ray.init let go of the previous Ray attachment itself
    session.cluster = attached  # the session's now: an interrupt below cannot orphan it
    if previous is not None:
        previous.detach()
    session.spares.close()  # the cluster's nodes start fresh ranks; local spares only hold memory
    print("taas: attached; " + "\n".join(attached.status_lines()))


def _detach(session: Session) -> None:
    if session.cluster is not None:
        cluster, session.cluster = session.cluster, None
        cluster.detach()


def hold_allocation(options: str) -> Attachment:
    """``%taas cluster slurm [OPTIONS]``: the job this kernel runs inside when no option is given
    and there is one, else a new allocation, its queue state shown live in the cell while it waits."""
    from IPython.display import display

    from taas_magic.launch.slurm import slurmcli
    from taas_magic.launch.slurm.allocation import AllocationRequest
    from taas_magic.launch.slurm.engine import SlurmCluster

    why = slurmcli.missing()
    if why is not None:
        raise ClusterError(f"taas: {why}")
    request = AllocationRequest.parse(options)
    if request.empty and os.environ.get("SLURM_JOB_ID"):
        return SlurmCluster.current()
    shown: list = []

    def show(line: str) -> None:
        if not shown:
            shown.append(display({"text/plain": line}, raw=True, display_id=True))
        else:
            shown[0].update({"text/plain": line}, raw=True)

    try:
        return SlurmCluster.request(request, show)
    except KeyboardInterrupt:
        raise ClusterError("taas: interrupted while the allocation was queued: it was cancelled, nothing is held") from None


def _status(session: Session, settings: MagicSettings) -> None:
    """``%taas status``: the last run, the devices, the defaults, the spares, the write rule, the cluster."""
    rule = session.write_rule()
    defaults = shown_defaults(settings.defaults)
    print(status_text(session.last_run, visible_gpu_count(), defaults,
                      [describe_registered(loader, settings.namespace) for loader in registry.registered()]))
    spares = session.spares
    factory = "" if spares.factory is None else \
        " with their factory (ready: new spares are forks)" if spares.forks_ready() else \
        " with their factory (still importing: new spares start fresh)"
    print(f"warm spares: {settings.warm}, {len(spares.spares)} waiting, {spares.resident_bytes() / 2**20:.0f} MB resident"
          f"{factory} (proportional: shared pages split)" + _spares_gpu_text(session))
    print("write rule: " + rule.header())
    running = session.runs.running()
    print(f"runs: {len(running)} running" + (f" ({', '.join(run.id for run in running)}; %taas runs lists them)"
                                             if running else ""))
    print("\n".join(session.cluster.status_lines()) if session.cluster is not None else "cluster: none (local processes)")


def _spares_gpu_text(session: Session) -> str:
    """What the GPU-bound spares hold on their GPUs (their CUDA contexts), for ``%taas status``."""
    bound = session.spares.gpu_bound()
    if not bound:
        return ""
    held = gpu_bytes(bound)
    amount = f"{held / 2**20:.0f} MiB" if held is not None else "GPU memory unknown (nvidia-smi cannot see them)"
    return f"; {len(bound)} bound to GPU(s) {', '.join(_gpu_name(s.binding) for s in bound)}, {amount} on the GPUs"


def _gpu_name(binding: Binding) -> str:
    """A spare's GPU as the person reads it: its index, or for a search trial's slice, which of that slice."""
    return str(binding.gpu) if binding.visible is None else f"{binding.gpu} of {binding.visible}"

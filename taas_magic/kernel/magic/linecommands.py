"""What the ``%taas`` line commands do to the session: ``status``, ``config repo PATH``, ``config
isolation auto|overlay|python``, ``warm off|auto|N``, ``cluster [ADDRESS|WORD [OPTIONS]|off]``;
``trials`` and ``study``, the last search's. The runs' are runcommands.py's; which line calls
which is the table of kernel/magic/commands.py.

Runs in the kernel, on the cell's thread.

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
from taas_magic.kernel.magic.status import kept_lines, status_text
from taas_magic.kernel.runs.rankset import heal_cell
from taas_magic.kernel.runs.session import Session, Warm
from taas_magic.kernel.supervision.dataplane import describe_registered
from taas_magic.kernel.trials.searchrun import SearchRun, trials_table
from taas_magic.launch import engines
from taas_magic.launch.rankenv import visible_gpu_count
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


def set_repository(session: Session, given: str) -> None:
    """``%taas config repo PATH``."""
    path = os.path.realpath(os.path.expanduser(given))
    if not os.path.isdir(path):
        raise UsageError(f"taas: the repository must be a directory, got {given!r}")
    session.repository = path
    print(f"taas: repository {path}")


def set_isolation(session: Session, mode: str) -> None:
    """``%taas config isolation auto|overlay|python``: overlay refused where this host has none."""
    if mode not in MODES:
        raise UsageError(f"taas: isolation must be one of {', '.join(MODES)}, got {mode!r}")
    unavailable = probe_overlay() if mode == OVERLAY else None
    if unavailable is not None:
        raise UsageError(f"taas: isolation overlay is unavailable on this host ({unavailable}); "
                         "use auto or python")
    session.isolation = mode
    print(f"taas: isolation {mode}")


def set_warm(session: Session, settings: MagicSettings, text: str) -> None:
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


def cluster(session: Session, given: str, word: str | None = None) -> None:
    """``%taas cluster`` (what is attached) | ``ADDRESS`` | ``WORD [OPTIONS]`` (the engine ``word``, launch/engines.py)
    | ``off`` (or ``local``)."""
    if not given and word is None:
        engines_said = [f"%taas cluster {engines.ADDRESSES.argument}: {engines.ADDRESSES.help}",
                        *(f"%taas cluster {word} [{engine.argument}]: {engine.help}"
                          for word, engine in engines.CLUSTER_WORDS.items())]
        print("\n".join(session.cluster.status_lines()) if session.cluster is not None
              else "\n  ".join(["cluster: none (local processes); attach one with", *engines_said]))
        return
    if session.kept is not None:  # kept ranks belong to where they started
        print(session.release_kept())
    previous = session.cluster
    try:
        attached = engines.attach(given, _shown_line(), word)  # the current one stays until this one holds
    except ClusterError:
        if previous is not None and not previous.attached:
            session.cluster = None  # its engine let go of it before failing (ray.init): the local mode now
        raise
    if attached is None:
        _detach(session)
        print("taas: local mode (ranks are processes on this host)")
        return
    session.cluster = attached  # the session's now: an interrupt below cannot orphan it
    if previous is not None and previous.attached:
        previous.detach()
    session.spares.close()  # the cluster's nodes start fresh ranks; local spares only hold memory
    print("taas: attached; " + "\n".join(attached.status_lines()))


def _detach(session: Session) -> None:
    if session.cluster is not None:
        cluster, session.cluster = session.cluster, None
        cluster.detach()


def _shown_line() -> Callable[[str], None]:
    """A line the cell shows and then replaces (a queued allocation's state, live)."""
    from IPython.display import display

    shown: list = []

    def show(line: str) -> None:
        if not shown:
            shown.append(display({"text/plain": line}, raw=True, display_id=True))
        else:
            shown[0].update({"text/plain": line}, raw=True)

    return show


def heal(session: Session, text: str) -> None:
    """``%taas heal --from K [NAME ...]``: rank K's names copied into the kept ranks that lack them (rank/heal.py),
    by a kept cell the magic runs."""
    words = text.split()
    if len(words) < 2 or words[0] != "--from" or not words[1].isdigit():
        raise UsageError("taas: %taas heal --from K [NAME ...]: K is the kept rank whose names are copied")
    kept, source, names = session.kept, int(words[1]), tuple(words[2:])
    if kept is None or not kept.running or session.runner is None:
        raise UsageError("taas: no kept ranks run now: %taas heal copies names between the ranks of --keep cells")
    if source >= kept.shape.ranks:
        raise UsageError(f"taas: the kept ranks are 0 to {kept.shape.ranks - 1}: there is no rank {source}")
    session.runner.run_cell(heal_cell(kept.shape, source, names))


def status(session: Session, settings: MagicSettings) -> None:
    """``%taas status``: the last run, the devices, the defaults, the spares, the write rule, the cluster."""
    rule = session.write_rule()
    defaults = shown_defaults(settings.defaults)
    print(status_text(session.last_run, visible_gpu_count(), defaults,
                      [describe_registered(loader, settings.namespace) for loader in registry.registered()]))
    print(session.spares.describe(settings.warm))
    print("write rule: " + rule.header())
    running = session.runs.running()
    print(f"runs: {len(running)} running" + (f" ({', '.join(run.id for run in running)}; %taas runs lists them)"
                                             if running else ""))
    print("\n".join(session.cluster.status_lines()) if session.cluster is not None else "cluster: none (local processes)")
    print("\n".join(kept_lines(session.kept)) if session.kept is not None else "kept ranks: none (--keep keeps them)")

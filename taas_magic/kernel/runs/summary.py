"""A run in a few words: the run's header line, its summary in ``%taas runs``, and the last run the session keeps.

Runs in the kernel: written by a run's plan step and its own thread, read on the cell's thread by
``%taas status`` and ``%taas runs``.

The run (kernel/runs/run.py) and its plan (kernel/runs/runplan.py) write these; the face's
``%taas status`` and ``%taas runs`` (kernel/magic/status.py) read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from taas_magic.cell.pragma import RunSettings
from taas_magic.launch.contract import DevicePlan


@dataclass(frozen=True)
class RunSummary:
    """A run as ``%taas runs`` lists it (kernel/runs/background.py makes them)."""

    run_id: str
    state: str
    ranks: int
    started: float  # time.time()
    detached: bool
    taken: bool
    last_line: str


@dataclass
class LastRun:
    """The last run, as the session keeps it (its one owner): what ``%taas status`` shows,
    ``taas.metrics()`` returns and ``taas.load_checkpoint()`` reads in the notebook. Small: no
    closure, no results, no log, only their names and the folder's path."""

    settings: RunSettings
    devices: DevicePlan
    run_id: str
    closure_names: tuple[str, ...]
    checkpoints: str = ""  # the run's checkpoint folder (taas.load_checkpoint in the notebook reads its newest)
    outcome: str = "running"
    seconds: float = 0.0
    metrics: list[dict] = field(default_factory=list)  # rank 0's reports as its board kept them (bounded), once it ended


def devices_text(devices: DevicePlan, ranks: object) -> str:
    if devices.device == "cuda":
        return f"{ranks} GPU(s) of {devices.gpus_on_host}, backend nccl"
    return "CPU (--device cpu), backend gloo" if devices.chosen else "CPU, backend gloo"


def closure_size(nbytes: int, route: str = "") -> str:
    """``closure 1.2 MB (one shared file)``: ``route`` says how its tensor bytes travel (handoff.closure_route)."""
    text = f"closure {nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"closure {nbytes} B"
    return f"{text} ({route})" if route else text


def header_line(settings: RunSettings, devices: DevicePlan, run_id: str, closure: str, why: str | None = None) -> str:
    """The run's first line; ``closure`` as :func:`closure_size` says it, ``why`` the ranks were chosen so."""
    ranks = f"taas: {settings.gpus} rank(s)" + (f" ({why})" if why else "")
    parts = [ranks, devices_text(devices, settings.gpus)]
    if settings.configs:
        parts.append("config " + ", ".join(settings.configs))
    parts.append(f"run {run_id}")
    if settings.restarts:
        parts.append(f"restarts up to {settings.restarts}")
    parts.append(closure)
    line = " · ".join(parts)
    if devices.notice:
        line += f"\ntaas: {devices.notice}"
    return line


def started_text(summary: RunSummary) -> str:
    return time.strftime("%H:%M:%S", time.localtime(summary.started))


def gpus_held_text(holder: RunSummary) -> str:
    """The one-line error when this host's GPUs are held by another run of this kernel."""
    return (f"taas: this host's GPUs are held by run {holder.run_id} ({holder.ranks} rank(s), "
            f"{'detached, ' if holder.detached else ''}started {started_text(holder)}); "
            f"%taas wait {holder.run_id} or %taas stop {holder.run_id} first, or run this cell with --device cpu")

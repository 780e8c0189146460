"""The text a person reads: the run header, ``%taas help`` and ``%taas status``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from taas_magic.cell.pragma import OPTIONS, RunSettings
from taas_magic.launch.rankenv import DevicePlan

LINE_COMMANDS = (
    ("%taas status", "the last run, the devices seen, the defaults, the write rule"),
    ("%taas config repo PATH", "set the repository (default: $TAAS_REPO, the git work tree, the cwd)"),
    ("%taas config isolation auto|overlay|python", "how other ranks' writes are diverted (auto: overlay where possible)"),
    ("%taas cluster ADDRESS|local", "run ranks on a Ray cluster (ray.init address), or back to this host"),
    ("%taas cluster slurm [OPTIONS]", "hold a Slurm allocation (salloc options; none: the job this kernel runs in)"),
    ("%taas cluster", "what is attached: its nodes, GPUs, time left; off releases it"),
    ("%taas warm off|auto|N", "warm spare ranks (torch imported) for the next cell; auto: as many as the last --gpus"),
    ("%taas runs", "this kernel's runs: state, ranks, start time, last line"),
    ("%taas attach [RUN]", "show a run's live view here: what it showed so far, then live until it ends"),
    ("%taas wait [RUN]", "wait for a (detached) run, then bind rank 0's names and return its value"),
    ("%taas stop [RUN]", "stop a run: every rank, with the autopsy of where they were"),
    ("%taas debug [RUN]", "the failing rank's traceback with each frame's locals (%debug too; %pdb on: a live prompt)"),
    ("%taas trials", "the last search's trials (a pandas DataFrame when pandas is installed); taas.trials()"),
    ("%taas study", "the last search's Optuna study; taas.study()"),
    ("%taas help", "this text"),
)


def _columns(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(left) for left, _ in rows) + 2
    return "\n".join(f"  {left:<{width}}{right}" for left, right in rows)


HELP = f"""\
taas: run one notebook cell as N DDP ranks.

  #!<config>                   optional config lines (e.g. #!g2.8), recorded and shown
  #pragma taas --gpus N        first line of the cell (or: %%taas --gpus N)

Options:
{_columns([(option.signature, option.help) for option in OPTIONS])}

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_RUN_ID, so init_process_group(init_method='env://') and
Lightning's Trainer(strategy="ddp") work unchanged. Rank 0's new or changed names come
back to the notebook; its last expression becomes the cell's result.

Only rank 0 writes to the repository (the git work tree holding the working directory):
the other ranks' writes there are diverted to a private layer, thrown away after the cell.

{_columns(LINE_COMMANDS)}"""


@dataclass(frozen=True)
class RunSummary:
    """A run as ``%taas runs`` lists it (kernel/background.py makes them)."""

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


def _devices_text(devices: DevicePlan, ranks: object) -> str:
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
    parts = [ranks, _devices_text(devices, settings.gpus)]
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


def help_text() -> str:
    return HELP


def status_text(last: LastRun | None, gpus_seen: int, defaults: Sequence[tuple[str, object]],
                registered: Sequence[str] = ()) -> str:
    """``defaults``: each option's session default, by flag (pragma.shown_defaults)."""
    lines = [f"devices seen: {gpus_seen} GPU(s)" if gpus_seen else "devices seen: no GPU (ranks run on CPU with gloo)"]
    lines.append("defaults: " + ", ".join(f"{flag} {value}" for flag, value in defaults))
    lines.append("registered loaders: " + ("; ".join(registered) or "none (taas.register(loader) adds one)"))
    if last is None:
        lines.append("last run: none yet")
    else:
        settings = last.settings
        lines.append(
            f"last run: {last.run_id}, --gpus {settings.gpus}, {_devices_text(last.devices, settings.gpus)}, "
            f"{last.seconds:.2f} s, {last.outcome}"
        )
        if settings.configs:
            lines.append("  config: " + ", ".join(settings.configs))
        lines.append("  names sent: " + (", ".join(last.closure_names) or "none"))
    return "\n".join(lines)


def _started(summary: RunSummary) -> str:
    return time.strftime("%H:%M:%S", time.localtime(summary.started))


def _state(summary: RunSummary) -> str:
    if summary.state == "running":
        return "running (detached)" if summary.detached else "running"
    if summary.taken or not summary.detached:
        return summary.state
    return f"{summary.state}, not taken (%taas wait {summary.run_id})"


def runs_table(summaries: Sequence[RunSummary]) -> str:
    """``%taas runs``: one row per run of this kernel, oldest first."""
    if not summaries:
        return "taas: no run in this kernel yet"
    rows = [("run", "state", "ranks", "started", "last line")]
    rows += [(s.run_id, _state(s), str(s.ranks), _started(s), s.last_line[-60:]) for s in summaries]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
                     for row in rows).rstrip()


def gpus_held_text(holder: RunSummary) -> str:
    """The one-line error when this host's GPUs are held by another run of this kernel."""
    return (f"taas: this host's GPUs are held by run {holder.run_id} ({holder.ranks} rank(s), "
            f"{'detached, ' if holder.detached else ''}started {_started(holder)}); "
            f"%taas wait {holder.run_id} or %taas stop {holder.run_id} first, or run this cell with --device cpu")

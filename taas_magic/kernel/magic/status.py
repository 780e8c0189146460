"""The text a person reads: the run header, ``%taas help`` and ``%taas status``."""

from __future__ import annotations

from typing import Sequence

from taas_magic.cell.options import OPTIONS
from taas_magic.kernel.runs.summary import LastRun, RunSummary, devices_text, started_text

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


def help_text() -> str:
    return HELP


def status_text(last: LastRun | None, gpus_seen: int, defaults: Sequence[tuple[str, object]],
                registered: Sequence[str] = ()) -> str:
    """``defaults``: each option's session default, by flag (options.shown_defaults)."""
    lines = [f"devices seen: {gpus_seen} GPU(s)" if gpus_seen else "devices seen: no GPU (ranks run on CPU with gloo)"]
    lines.append("defaults: " + ", ".join(f"{flag} {value}" for flag, value in defaults))
    lines.append("registered loaders: " + ("; ".join(registered) or "none (taas.register(loader) adds one)"))
    if last is None:
        lines.append("last run: none yet")
    else:
        settings = last.settings
        lines.append(
            f"last run: {last.run_id}, --gpus {settings.gpus}, {devices_text(last.devices, settings.gpus)}, "
            f"{last.seconds:.2f} s, {last.outcome}"
        )
        if settings.configs:
            lines.append("  config: " + ", ".join(settings.configs))
        lines.append("  names sent: " + (", ".join(last.closure_names) or "none"))
    return "\n".join(lines)


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
    rows += [(s.run_id, _state(s), str(s.ranks), started_text(s), s.last_line[-60:]) for s in summaries]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
                     for row in rows).rstrip()
